"""A rank's intra-op threads: its CPU device's share of this machine's cores.

A rank's program is built on the meta device (:mod:`tppc.distributed.pipeline`), so its
worker carries no thread count (``StageProgram.threads`` is None); the rank sets its own
here, as the threads executor sets each worker's (:mod:`tppc.program.cores`).

Example:
    >>> set_rank_threads(CompileOptions(cluster="2xcpu"), 0, torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import os

import torch

from tppc.cost_models.cluster import Cluster, cpu_device_count
from tppc.driver.options import CompileOptions
from tppc.program.cores import rank_threads

__all__ = ["set_rank_threads"]


def set_rank_threads(opts: CompileOptions, stage: int, where: torch.device) -> int | None:
    """Set this rank's intra-op threads (``torch.set_num_threads``) and return them.

    A rank on a CPU device runs ``opts.threads_per_stage`` where given (one count, or one
    per stage: ``stage``'s), else its device's share: the machine's physical cores shared by
    the CPU devices on this machine — the job's ranks here (``LOCAL_WORLD_SIZE``, else
    ``WORLD_SIZE``) or the CPU devices of the plan's cluster when it names one machine,
    whichever is more (:func:`tppc.program.cores.rank_threads`). A rank on another device
    keeps torch's count (returns None).
    """
    if where.type != "cpu":
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    c = opts.cluster
    one_machine = len(set(c.nodes)) <= 1 if isinstance(c, Cluster) else "(" not in c
    threads = rank_threads(opts.threads_per_stage, stage, local,
                           cpu_device_count(c) if one_machine else 0)
    torch.set_num_threads(threads)
    return threads
