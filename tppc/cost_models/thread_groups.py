"""Collectives of CPU worker threads: what the threads executor's meetings cost, measured.

A stage sharded over ``n`` worker threads of one CPU (``tensor_parallel`` on ``2xcpu``) joins
its workers at every collective in a meeting of shared buffers
(:class:`tppc.program.threads.ThreadWorld`): each member puts its values, the last one to
come computes the whole result alone (a sum of the partial sums; a ``cat`` of the gathered
pieces into fresh memory) while the others wait, then every member goes on. Nothing moves
over a link, so the link model of :mod:`.collective_costs` (latency + bytes / bandwidth of
NCCL's rings) does not describe it. It costs, per collective:

    handoff α: the lock, the notify and the wake-ups when every member comes at once;
    serial combine: the last member's ``n - 1`` adds of the B-byte buffer (all-reduce), or
        its copy of the B gathered bytes into new pages (all-gather; nothing when every
        member wrote its piece of one output in place: ``in_place``);
    barrier wait: members that compute the same work do not finish together (they share
        the memory bandwidth, the OS moves them); everyone waits for the last, so each
        barrier adds a fraction ``κ`` (``imbalance``) of the compute since the one before.

Formulas (seconds; B bytes as :mod:`.collective_costs` counts them; rates measured with
``members`` threads, one intra-op thread each)::

    all_reduce      α + (n - 1) · B / reduce_bandwidth
    all_gather      α + B / gather_bandwidth           (α alone when in place)
    reduce_scatter  α + (n - 1) · B / reduce_bandwidth (the sum, then a copy of B / n each)
    all_to_all      α + B / gather_bandwidth
    barrier wait    κ · (the layer's compute on one worker), for a layer with a collective

:func:`measure_thread_group` measures α, both rates and κ on the executor's own meeting
(:mod:`.calibration` caches them with the CPU's other rates); :func:`thread_collective_seconds`
prices one collective. They apply only to groups of CPU devices whose spec carries a
:class:`ThreadGroupSpec` (a calibrated ``cpu``); every other group keeps the link model.

Example:
    >>> spec = ThreadGroupSpec(handoff=5e-5, reduce_bandwidth=4e9, gather_bandwidth=2e9,
    ...                        imbalance=0.02, members=2)
    >>> round(thread_collective_seconds(spec, "all_reduce", 4e6, 2) * 1e3, 3)   # ms
    1.05
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tppc.errors import SpecError

__all__ = ["ThreadGroupSpec", "measure_thread_group", "thread_collective_seconds",
           "thread_group_of"]


@dataclass(frozen=True, kw_only=True)
class ThreadGroupSpec:
    """The measured prices of a meeting of CPU worker threads (module docstring).

    Attributes:
        handoff: seconds per collective when every member comes at once (α).
        reduce_bandwidth: bytes/s of the last member's sum (bytes of one buffer per add).
        gather_bandwidth: bytes/s of the last member's ``cat`` into fresh memory (bytes of
            the gathered output).
        imbalance: κ, the fraction of the compute between two barriers that a barrier adds
            (the last member's lateness), >= 0.
        members: threads measured together.
    """

    handoff: float
    reduce_bandwidth: float
    gather_bandwidth: float
    imbalance: float
    members: int = 2

    def __post_init__(self) -> None:
        for name in ("handoff", "imbalance"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise SpecError(f"ThreadGroupSpec: {name} must be a finite number >= 0, got "
                                f"{value!r}; calibrate again (tppc.calibrate('cpu', force=True))")
        for name in ("reduce_bandwidth", "gather_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise SpecError(f"ThreadGroupSpec: {name} must be bytes/s > 0, got {value!r}; "
                                "calibrate again (tppc.calibrate('cpu', force=True))")

    @classmethod
    def from_measured(cls, measured: dict[str, float]) -> ThreadGroupSpec | None:
        """The spec in a calibration's measured fields (``group_*``), None when absent."""
        if "group_handoff" not in measured:
            return None
        return cls(handoff=measured["group_handoff"],
                   reduce_bandwidth=measured["group_reduce_bandwidth"],
                   gather_bandwidth=measured["group_gather_bandwidth"],
                   imbalance=measured["group_imbalance"],
                   members=int(measured.get("group_members", 2)))


def thread_collective_seconds(spec: ThreadGroupSpec, kind: str, nbytes: float, n: int,
                              in_place: bool = False) -> float:
    """Seconds of one collective of ``n`` threads on ``nbytes`` (the module's formulas).

    Raises:
        SpecError: an unknown collective kind.
    """
    if n <= 1:
        return 0.0
    if kind in ("all_reduce", "reduce_scatter"):
        return spec.handoff + (n - 1) * nbytes / spec.reduce_bandwidth
    if kind in ("all_gather", "all_to_all"):
        return spec.handoff + (0.0 if in_place else nbytes / spec.gather_bandwidth)
    raise SpecError(f"collective {kind!r} is not priced for a thread group; use all_reduce, "
                    "all_gather, reduce_scatter or all_to_all")


def thread_group_of(devices: list) -> ThreadGroupSpec | None:
    """The thread-group spec of a group of devices: every member a CPU with one, else None
    (a GPU group, or a CPU calibrated without groups: the link model prices it)."""
    specs = [getattr(d, "thread_group", None) for d in devices]
    if len(devices) < 2 or any(s is None for s in specs) or any(d.name != "cpu" for d in devices):
        return None
    return specs[0]


Timer = Callable[[Callable[[], object], int], float]


def _world(members: int):
    """A meeting of the threads executor for ``members`` threads, and its collective."""
    from tppc.program.collectives import CollectiveOps
    from tppc.program.threads import ThreadWorld

    # the threads executor's torch array ops (backends' TORCH_OPS: a floor above this one)
    ops = CollectiveOps(cat=lambda arrays, axis: torch.cat(list(arrays), axis),
                        split=lambda array, n, axis: torch.tensor_split(array, n, axis),
                        copy=torch.clone)
    dry = SimpleNamespace(actions=[()] * members, groups=(("g", tuple(range(members))),))
    return ThreadWorld(dry, 0, ops)  # type: ignore[arg-type]


def _run_members(members: int, body: Callable[[int, Callable], None]) -> float:
    """Seconds until ``members`` threads (one intra-op thread each) have run
    ``body(rank, meet)``; ``meet(kind, tensor)`` is one collective of them all."""
    from tppc.program.actions import Action

    world = _world(members)
    acts = {kind: Action(0, 0, 0, 1, kind, group="g", dims=(0,), first=1)  # type: ignore[arg-type]
            for kind in ("all_reduce", "all_gather")}
    start = threading.Barrier(members + 1)

    def work(rank: int) -> None:
        torch.set_num_threads(1)
        end = world.end(rank)
        start.wait()
        with torch.inference_mode():
            body(rank, lambda kind, x: end.collective(acts[kind], (x,)))

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(members)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _best(members: int, body: Callable[[int, Callable], None], reps: int) -> float:
    """The fastest of ``reps`` runs (the least disturbed, as every calibration timing)."""
    return min(_run_members(members, body) for _ in range(reps))


def measure_thread_group(members: int = 2, rounds: int = 10) -> dict[str, float]:
    """α, the reduce and gather rates and κ of ``members`` worker threads (the module
    docstring), as ``group_*`` fields of a calibration; about 1 s.

    α: 200 all-reduces of one float, every member at once. Reduce rate: all-reduces of
    8 MiB, α subtracted. Gather rate: all-gathers of 32 MiB outputs. κ: ``rounds`` segments
    of two 1024 × 1024 linears on 128 rows per member (a few ms each), a one-float
    all-reduce after each, against the same segments without them (α subtracted).
    """
    small = 200
    alpha = _best(members, lambda r, meet: [meet("all_reduce", torch.ones(1))
                                            for _ in range(small)], 3) / small
    nbytes, reps = 8 * 2**20, 4
    x = [torch.ones(nbytes // 4) for _ in range(members)]
    t = _best(members, lambda r, meet: [meet("all_reduce", x[r]) for _ in range(reps)], 3)
    reduce_bw = (members - 1) * nbytes / max(t / reps - alpha, 1e-9)
    out, reps = 32 * 2**20, 4
    pieces = [torch.ones(out // 4 // members) for _ in range(members)]
    t = _best(members, lambda r, meet: [meet("all_gather", pieces[r]) for _ in range(reps)], 3)
    gather_bw = out / max(t / reps - alpha, 1e-9)
    w = [torch.randn(1024, 1024) for _ in range(2)]
    rows = [torch.randn(128, 1024) for _ in range(members)]

    def segments(barrier: bool) -> Callable[[int, Callable], None]:
        def body(r: int, meet: Callable) -> None:
            for _ in range(rounds):
                for weight in w:
                    torch.nn.functional.linear(rows[r], weight)
                if barrier:
                    meet("all_reduce", torch.ones(1))
        return body

    runs = [(_run_members(members, segments(False)), _run_members(members, segments(True)))
            for _ in range(3)]  # alternated: both see the same disturbances
    free, joined = min(r[0] for r in runs), min(r[1] for r in runs)
    kappa = max(0.0, (joined - rounds * alpha - free) / free)
    return {"group_handoff": alpha, "group_reduce_bandwidth": reduce_bw,
            "group_gather_bandwidth": gather_bw, "group_imbalance": kappa,
            "group_members": float(members)}
