"""The distributed pipeline: one rank per stage, and how its outputs reach rank 0.

``pipeline`` ``DistributedPipeline`` and ``compile_distributed`` (one rank of a
torch.distributed job); ``job`` joining the job and sizing it to a plan; ``generate`` and
``denoise`` the same loops on every rank;
``validate`` rank 0 checks the program, every rank obeys; ``checkpoint`` models without
weights and one stage's tensors; ``rank_delivery`` how a call's outputs leave the last rank,
over ``result_stream`` (chunk by chunk) or ``shared_results`` (shared memory).
"""

from __future__ import annotations

__all__: list[str] = []
