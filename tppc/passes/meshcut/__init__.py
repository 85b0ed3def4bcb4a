"""The data cuts of a stage over its mesh of workers (issue 29): the batch cut (CFG
parallelism, ``batch_cut``), the token cut with its exchanges around attention (Ulysses and
Ring, ``token_cut``; the run-time row helpers in ``rows``), and one worker's graph of a stage
(``worker_graph``: the tensor-parallel shard, then the cuts, then the gathers of the last
stage's outputs), plus a lockstep reference runner of the workers' parts (``lockstep``).

Reads the sharding pass (its cut rules, marks and shards); read by the emitter.
"""

from __future__ import annotations

__all__: list[str] = []
