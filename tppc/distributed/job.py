"""The job a distributed pipeline runs in: joining it, and its size against a plan's.

Terms:
    job: ``W`` processes started together (``torchrun --nproc-per-node W``, a multi-node
        c10d rendezvous, or :func:`tppc.launch`); rank ``r`` runs worker ``r`` of the
        program (:attr:`tppc.program.program.Program.runners`) on its local device
        (``cuda:LOCAL_RANK`` with NCCL, else CPU with gloo). Without tensor parallelism a
        worker is a stage (``W = S``); a stage of degree ``t`` has ``t`` workers, in rank
        order (PP2 × TP2: ranks 0, 1 run stage 0's shards, ranks 2, 3 stage 1's), and its
        collectives run over a process group of its ranks. ``W`` must be the plan's worker
        count (the error names both).

:func:`init_distributed` joins the job from torchrun's environment; :func:`stages_for` sizes
the stages of a job from the degrees given; :func:`check_world` refuses a program whose
worker count is not the job's size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tppc.distributed.shared_results import sweep_dead
from tppc.driver.options import check_seconds
from tppc.errors import SpecError
from tppc.program.mesh import AXES, Mesh
from tppc.program.program import Program

__all__ = ["DEGREES", "check_world", "group_degree", "init_distributed", "stages_for"]


def init_distributed(timeout: float = 60.0, device: str = "auto"
                     ) -> tuple[int, int, torch.device]:
    """Join the job (from torchrun's environment) unless already joined.

    Args:
        timeout: seconds any collective or point-to-point operation may wait.
        device: ``"auto"`` (``cuda:LOCAL_RANK`` when CUDA is present, else CPU), ``"cpu"``
            or ``"cuda"``.

    Returns:
        ``(rank, world size, this rank's device)``.

    Joining also removes the shared-output files of dead processes on this machine
    (:func:`tppc.distributed.shared_results.sweep_dead`).
    """
    check_seconds("comm_timeout", timeout)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    where = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise SpecError("backend='distributed' needs a job: RANK and WORLD_SIZE are not set. "
                            "fix: start with `torchrun --nproc-per-node S ...` or tppc.launch")
        if use_cuda:  # survivors of a dead peer raise instead of hanging for the watchdog
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
            torch.cuda.set_device(where)
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=timedelta(seconds=timeout),
                                device_id=where if use_cuda else None)
        sweep_dead()  # shared outputs an earlier job's killed rank left on this machine
    return dist.get_rank(), dist.get_world_size(), where


DEGREES = ("cfg_parallel", "ulysses", "ring", "tensor_parallel")
"""The degrees a user may give by keyword (``num_stages`` apart)."""


def group_degree(options: Mapping[str, Any]) -> int:
    """The product of the degrees that every stage shares (``cfg_parallel``, ``ulysses``,
    ``ring``; 1 where not given)."""
    n = 1
    for name in ("cfg_parallel", "ulysses", "ring"):
        d = options.get(name)
        n *= d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else 1
    return n


def stages_for(world: int, tensor_parallel: int | tuple[int, ...] | None, shared: int = 1
                ) -> int:
    """The stages of a job of ``world`` ranks at ``tensor_parallel`` (None: 1 per stage),
    every stage's group ``shared`` times that (cfg, ring, ulysses)."""
    if isinstance(tensor_parallel, tuple | list):
        return len(tensor_parallel)
    t = (tensor_parallel or 1) if isinstance(tensor_parallel, int) and tensor_parallel >= 1 \
        else 1
    if world % (t * shared):
        raise SpecError(f"a group of {t * shared} devices per stage (tensor_parallel={t} "
                        f"times cfg_parallel x ring x ulysses = {shared}) does not divide the "
                        f"job's {world} ranks into stages. fix: launch a multiple of "
                        f"{t * shared} ranks, or give num_stages= and the degrees")
    return max(1, world // (t * shared))


def check_world(program: Program, world: int) -> None:
    """Refuse a job whose size is not ``program``'s worker count (one rank per worker).

    Raises:
        SpecError: naming both numbers and the job size to launch.
    """
    workers = len(program.runners)
    if workers != world:
        if program.meshes:
            what = "groups " + ", ".join(f"{m.size} ({_label(m)})" for m in program.meshes)
        else:
            what = "tensor-parallel degrees " + str(
                [sum(w.index == s for w in program.runners) for s in range(len(program.stages))])
        raise SpecError(
            f"the plan needs {workers} ranks ({len(program.stages)} stages at {what}: one "
            f"rank per worker), the job has {world}. fix: launch "
            f"{workers} processes (torchrun --nproc-per-node {workers}, or "
            f"tppc.launch(..., {workers})), or plan for {world} devices")


def _label(mesh: Mesh) -> str:
    return " x ".join(f"{a}{getattr(mesh, a)}" for a in AXES if getattr(mesh, a) > 1) or "1"
