"""Compile options, validated up front: :class:`CompileOptions`.

Every option that can be wrong is checked when the pipeline is compiled, before anything is
captured, and a :class:`tppc.errors.SpecError` names the option, its value and the fix.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tppc.cost_models.cluster import Cluster
from tppc.errors import RuntimeInputError, SpecError

__all__ = ["CompileOptions", "ExecutorName", "check_devices", "check_executor", "check_seconds",
           "chunk_bounds", "memory_bytes"]

ExecutorName = Literal["local", "threads", "distributed"]
EXECUTORS: tuple[ExecutorName, ...] = ("local", "threads", "distributed")


@dataclass(kw_only=True, frozen=True)
class CompileOptions:
    """How ``tppc.compile`` and ``tppc.plan`` plan, emit and run (see :func:`tppc.compile`).

    ``tppc.plan`` reads the planning fields (``cluster``, ``chunks``, ``num_stages``,
    ``granularity``, ``time_limit``, ``verbose``); lengths are in units of the sequence axis
    (:attr:`tppc.planner.plan.Plan.unit`).
    """

    cluster: str | Cluster = "2xcpu"
    """Cluster priced by the cost model: a string (``"2xcpu"``, ``"4xh100-sxm"``) or a
    :class:`~tppc.cost_models.cluster.Cluster`."""
    executor: ExecutorName = "threads"
    """``"threads"`` (one worker per stage), ``"local"`` (the reference), or ``"distributed"``
    (one process per stage; set by ``backend="distributed"``, see :mod:`tppc.distributed.pipeline`)."""
    chunks: int | tuple[int, ...] | None = None
    """Override the planner's split: a number of equal chunks, or the boundaries."""
    devices: tuple[str | torch.device, ...] | None = None
    """One torch device per stage (default: ``cpu`` for CPU presets, else ``cuda:i``)."""
    verify: bool | Literal["full"] = True
    """Check the emitted program against the captured graph before returning it (real weights;
    see :mod:`tppc.validation.validate`): a long example is checked at two short lengths,
    ``"full"`` checks it at its own length too (a few forwards of the model), False skips."""
    max_seq: int | None = None
    """Longest sequence (prompt + generated tokens) accepted; None: no limit."""
    num_stages: int | None = None
    """Stages to plan for (default: the planner's choice)."""
    tensor_parallel: int | tuple[int, ...] | None = None
    """Devices per stage, each a shard of the stage's heads and MLP columns (tensor
    parallelism): one degree for every stage, or a tuple, one per stage (its length fixes
    the stage count); None: the planner chooses, by price, among the degrees the model's
    shard sizes and the cluster's nodes allow (:mod:`tppc.planner.hybrid`)."""
    intra_op: int | None = None
    """CPU devices (of one machine) whose cores ONE worker runs as its intra-op threads, torch
    splitting every op (the CPU analogue of a tensor-parallel group, without shards or
    collectives): ``k`` gives every stage ``k`` devices and a worker of ``k`` threads; 1
    excludes it; None: the planner prices it (on a calibration measured with ``k`` threads)
    beside the tensor-parallel degrees (LLMs) or the CFG, Ulysses and Ring degrees (DiTs:
    each of their workers of ``k`` threads), on clusters of CPU devices only."""
    cfg_parallel: int | None = None
    """Groups that each run ``1/c`` of a guided call's batch (classifier-free guidance: 2,
    the prompt and the negative prompt); None: the planner chooses (diffusion transformers;
    1 for other models)."""
    ulysses: int | None = None
    """Devices that each hold ``1/u`` of the tokens and trade them for heads around each
    attention (Ulysses sequence parallelism; must divide the head count); None: chosen."""
    ring: int | None = None
    """Devices that each hold ``1/r`` of the tokens and pass K/V blocks around (Ring
    attention); None: chosen."""
    patches: int | None = None
    """PipeFusion patches per denoising step (equal bands of rows; diffusion plans only);
    None: the planner chooses."""
    memory_limit: int | float | str | None = None
    """Usable memory per device: bytes, or a string such as ``"24GB"`` / ``"20GiB"``; a plan
    that needs more is infeasible, and the error names the stage and its need. None: each
    device's capacity."""
    objective: Literal["latency", "throughput_per_device"] = "latency"
    """What the planner minimises across degrees: one call's latency, or latency × the
    devices of one pipeline (:attr:`tppc.planner.workload.Workload.objective`)."""
    granularity: int | None = None
    """Chunk sizes are multiples of this many units of the sequence axis (the last chunk may
    be shorter); None: automatic (one patch row for a DiT)."""
    threads_per_stage: int | tuple[int, ...] | None = None
    """Intra-op threads of each ``threads`` worker, one count or one per stage (None: each
    worker its plan device's share: the machine's cores shared equally by the cluster's
    CPU devices, at least one each, whatever torch's own count is; an ``intra_op=k`` stage's
    worker ``k`` shares). A count given here overrides both."""
    queue_depth: int = 2
    """Chunks that may wait between two stages."""
    time_limit: float = 10.0
    """Seconds for the planner's solver (per planned length); on expiry the best plan found
    is used and its ``solver.status`` says ``"time_limit"``."""
    timeout: float | None = None
    """Seconds a call may take before :class:`tppc.errors.StageTimeout` (None: no limit)."""
    program_cache: int = 8
    """Programs (one per sequence length and batch shape) kept, least recently used first out."""
    keep_states: int = 1
    """Idle call states (K/V buffers) kept per batch shape for the next call."""
    verbose: bool = False
    """Print the time of capture and of each plan to stderr (``[tppc plan] ...``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, str | Cluster):
            raise SpecError(f"cluster={self.cluster!r} must be a cluster string such as "
                            "'4xh100-sxm' or a tppc.Cluster")
        if self.executor not in EXECUTORS:
            raise SpecError(f"executor={self.executor!r}; use one of {list(EXECUTORS)}")
        _check_chunks(self.chunks)
        if self.verify not in (True, False, "full"):
            raise SpecError(f"verify={self.verify!r}; use True (the default), 'full' (also "
                            "check at the example's own length) or False (skip)")
        _positive("max_seq", self.max_seq)
        _positive("num_stages", self.num_stages)
        _check_tensor_parallel(self.tensor_parallel, self.num_stages)
        _positive("intra_op", self.intra_op)
        tp = self.tensor_parallel
        if (self.intra_op or 1) > 1 and any(t > 1 for t in (tp if isinstance(tp, tuple)
                                                             else (tp or 1,))):
            raise SpecError(f"intra_op={self.intra_op} and tensor_parallel={tp} both give a "
                            "stage several devices (one worker of intra-op threads; sharded "
                            "workers): a stage is one or the other. fix: drop one of them")
        for name in ("cfg_parallel", "ulysses", "ring", "patches"):
            _positive(name, getattr(self, name))
        if self.patches is not None and self.chunks is not None:
            raise SpecError(f"patches={self.patches} and chunks={self.chunks} both fix the "
                            "split. fix: give one of them (patches: diffusion plans)")
        memory_bytes(self.memory_limit)
        if self.objective not in ("latency", "throughput_per_device"):
            raise SpecError(f"objective={self.objective!r}; use 'latency' (one call) or "
                            "'throughput_per_device' (calls per second per device)")
        _positive("granularity", self.granularity)
        _positive("queue_depth", self.queue_depth, optional=False)
        _positive("program_cache", self.program_cache, optional=False)
        _positive("keep_states", self.keep_states, optional=False, minimum=0)
        threads = self.threads_per_stage
        for t in (threads,) if threads is None or isinstance(threads, int) else threads:
            _positive("threads_per_stage", t)
        check_seconds("time_limit", self.time_limit)
        check_seconds("timeout", self.timeout)
        check_devices(self.devices)

    @property
    def memory_limit_bytes(self) -> int | None:
        """:attr:`memory_limit` in bytes (None: no limit)."""
        return memory_bytes(self.memory_limit)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CompileOptions:
        """Options from ``tppc.compile``'s or ``tppc.plan``'s keywords (sequences become tuples).

        Raises:
            SpecError: an unknown option name, or a bad value (see the class).
        """
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            raise SpecError(f"unknown compile option(s) {unknown}; the options are "
                            f"{sorted(cls.__dataclass_fields__)}")
        for name in ("chunks", "devices", "threads_per_stage", "tensor_parallel"):
            value = kwargs.get(name)
            if isinstance(value, Sequence) and not isinstance(value, str):
                kwargs[name] = tuple(value)
        return cls(**kwargs)


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def memory_bytes(value: Any) -> int | None:
    """A memory limit in bytes: a positive number of bytes or a string ``"24GB"``,
    ``"20 GiB"`` (None: no limit).

    Raises:
        SpecError: naming the value and the forms accepted.
    """
    if value is None:
        return None
    number, unit = value, "B"
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), "")
        try:
            number = float(text[:len(text) - len(unit)])
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int | float) or unit not in _UNITS \
            or not 0 < number < math.inf:
        raise SpecError(f"memory_limit={value!r} must be a positive number of bytes or a "
                        "string such as '24GB' or '20GiB' (per device). fix: e.g. "
                        "memory_limit='40GB'")
    return int(number * _UNITS[unit])


def check_executor(executor: Any) -> None:
    """Refuse an executor name tppc does not have (:class:`SpecError` naming it)."""
    if executor not in EXECUTORS:
        raise SpecError(f"executor={executor!r}; use one of {list(EXECUTORS)}")


def check_seconds(name: str, value: Any) -> None:
    """Refuse a time limit that is not a positive finite number of seconds (None: no limit).

    Raises:
        SpecError: naming the limit and its value (0, negative, NaN, infinite, not a number).
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 < value < math.inf:
        none = f", or {name}=None for no limit" if name == "timeout" else ""
        raise SpecError(f"{name}={value!r} must be a positive number of seconds. fix: e.g. "
                        f"{name}=30{none}")


def check_devices(devices: Any) -> None:
    """Refuse devices this machine does not have (a CUDA device without CUDA, a bad name).

    Raises:
        SpecError: naming the device, what this machine has, and the fix.
    """
    for d in devices or ():
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise SpecError(f"devices contains {d!r}, which is not a torch device ({exc}). "
                            "fix: e.g. devices=('cpu', 'cpu') or ('cuda:0', 'cuda:1')") from exc
        if device.type != "cuda":
            continue
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            has = f"{count} CUDA device(s)" if count else "no CUDA (torch.cuda.is_available() " \
                "is False)"
            raise SpecError(f"devices contains {d!r}, but this machine has {has}. fix: pass "
                            "devices=None (the cluster's default) or CPU devices, e.g. "
                            "devices=('cpu', 'cpu'); or run on a machine with that GPU")


def _positive(name: str, value: Any, *, optional: bool = True, minimum: int = 1) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name}={value!r} must be an integer ≥ {minimum}"
                        + (" or None" if optional else ""))


def _check_tensor_parallel(value: Any, num_stages: int | None) -> None:
    if value is None:
        return
    degrees = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(degrees, tuple) or not degrees or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in degrees):
        raise SpecError(f"tensor_parallel={value!r} must be an integer ≥ 1 (devices per "
                        "stage) or a tuple of them, one per stage. fix: e.g. "
                        "tensor_parallel=2 or tensor_parallel=(4, 2)")
    if isinstance(value, tuple) and num_stages is not None and num_stages != len(value):
        raise SpecError(f"tensor_parallel={value} names {len(value)} stages, num_stages="
                        f"{num_stages}. fix: one degree per stage, or num_stages=None")


def _check_chunks(chunks: Any) -> None:
    if chunks is None:
        return
    if isinstance(chunks, int) and not isinstance(chunks, bool):
        if chunks < 1:
            raise SpecError(f"chunks={chunks} must be ≥ 1 (the number of chunks per call)")
        return
    bounds = tuple(chunks) if isinstance(chunks, Sequence) else None
    if not bounds or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise SpecError(f"chunks={chunks!r} must be a number of chunks or token boundaries "
                        "(0, b1, ..., L)")
    if len(bounds) < 2 or bounds[0] != 0 or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise SpecError(f"chunks={bounds} must be strictly increasing boundaries from 0 to the "
                        "sequence length, e.g. (0, 8, 16)")


def chunk_bounds(chunks: int | tuple[int, ...], length: int) -> tuple[int, ...]:
    """Boundaries of ``chunks`` (a count or boundaries) for a call of ``length`` tokens.

    A count larger than ``length`` gives one-token chunks (never empty ones).

    Raises:
        RuntimeInputError: boundaries that do not end at ``length``.
    """
    if isinstance(chunks, int):
        count = min(chunks, length)
        return tuple(round(i * length / count) for i in range(count + 1))
    if chunks[-1] != length:
        raise RuntimeInputError(
            f"chunks={chunks} ends at {chunks[-1]} tokens, the call has {length}. fix: call "
            f"with {chunks[-1]} tokens, or compile with chunks=<number of chunks>")
    return chunks
