"""The plan: which device runs which layers, where the sequence is cut, and what it costs.

Terms:
    stage: a contiguous range of layers ``[start, end)`` on one device of the chain; stage
        ``s`` sends its output activations to stage ``s + 1``.
    chunk: a contiguous range of tokens ``[a, b)``; chunks enter stage 0 in order.
    job: one chunk of one pipelined step (prefill: the chunk; diffusion: step × chunk).
    latency: the makespan of the flow-shop simulation (:mod:`tppc.program.schedule`),
        warm-up steps included.
    lower bound: no plan on these devices can be faster (under the roofline assumption that
        cutting a chunk never reduces its work): the larger of the serial time divided by
        the number of stages and the time for the last chunk to cross every layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tppc.errors import PlanError

__all__ = ["PLAN_SCHEMA", "Plan", "SolverInfo", "SplitSearch", "StagePlan", "Workload",
           "say_expired"]

PLAN_SCHEMA = "tppc.plan/2"
"""Schema tag written by :meth:`Plan.to_json`; bumped on incompatible changes (2: the unit,
``tokens_per_unit``). :meth:`Plan.from_json` also reads schema 1, whose plans count tokens."""

_READS = ("tppc.plan/1", PLAN_SCHEMA)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one call of the pipeline computes.

    Attributes:
        kind: ``"causal_prefill"`` (one pass, attention cost grows with the prefix),
            ``"bidirectional_pass"`` (one pass of a model with bidirectional attention, e.g.
            a DiT's call, one denoising step: one chunk, exact; planned as a prefill) or
            ``"diffusion"`` (``steps`` denoising steps over every chunk, bidirectional).
            ``tppc.plan`` names the one-pass kind after the model's attention.
        steps: denoising steps ``D`` (1 for a one-pass kind).
        warmup_steps: leading steps that run the full sequence synchronously (diffusion).
        max_patches: at most this many patches per step (diffusion; ``None``: any). More
            patches make more of the K/V stale (a quality limit, ``cp.denoise(quality=...)``).
    """

    kind: Literal["causal_prefill", "bidirectional_pass", "diffusion"] = "causal_prefill"
    steps: int = 1
    warmup_steps: int = 0
    max_patches: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("causal_prefill", "bidirectional_pass", "diffusion"):
            raise PlanError(f"Workload.kind={self.kind!r}; use 'causal_prefill', "
                            "'bidirectional_pass' or 'diffusion'")
        if self.steps < 1:
            raise PlanError(f"Workload.steps={self.steps} must be at least 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise PlanError(
                f"Workload.warmup_steps={self.warmup_steps} must lie in [0, steps={self.steps}]"
            )
        if self.kind != "diffusion" and (self.steps != 1 or self.warmup_steps != 0):
            raise PlanError(
                f"{self.kind} runs one step; got steps={self.steps}, "
                f"warmup_steps={self.warmup_steps} (use kind='diffusion' for multi-step)"
            )
        if self.max_patches is not None and (self.kind != "diffusion" or self.max_patches < 1):
            raise PlanError(f"Workload.max_patches={self.max_patches} must be None, or an "
                            "integer >= 1 with kind='diffusion'")

    def patch_cap(self, max_chunks: int | None) -> int | None:
        """``max_chunks`` lowered to :attr:`max_patches` (``None`` where neither limits)."""
        caps = [c for c in (max_chunks, self.max_patches) if c is not None]
        return min(caps) if caps else None

    @property
    def pipelined_steps(self) -> int:
        """Steps that run chunk by chunk through the pipeline (``steps - warmup_steps``)."""
        return self.steps - self.warmup_steps


@dataclass(frozen=True, kw_only=True)
class SolverInfo:
    """Provenance of a solve.

    Attributes:
        solver: e.g. ``"milp-highs"``, ``"milp-cbc"``, ``"terapipe-dp"``, ``"exhaustive"``.
        status: ``"optimal"``, ``"time_limit"`` (incumbent, see ``gap``) or ``"heuristic"``.
        objective: the minimised objective (seconds; the latency bound of the model).
        bound: best proven lower bound on that objective.
        gap: relative gap ``(objective - bound) / objective``.
        seconds: wall-clock solve time.
        detail: free text (pruning statistics, decomposition rounds...).
    """

    solver: str
    status: str
    objective: float
    bound: float
    gap: float
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class SplitSearch:
    """The certified search over chunk boundaries for the plan's placement
    (:mod:`tppc.planner.certify`).

    Attributes:
        method: how the split was searched.
        status: ``"optimal"`` (no split of the placement simulates faster), ``"time_limit"``
            or ``"label_limit"`` (the best split found, see ``gap``).
        bound: lower bound on the latency of every split of this placement on the grid.
        gap: ``(latency - bound) / latency``.
        seconds: wall-clock time of the search.
    """

    method: str
    status: str
    bound: float
    gap: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
        index: stage number (0 is the first).
        layer_start: first layer (inclusive).
        layer_end: last layer (exclusive).
        device_index: position of the device in the cluster chain.
        device_name: the device's preset name.
        memory_bytes: predicted peak memory (weights + K/V buffers + in-flight activations).
        capacity_bytes: the device's usable memory.
        layer_names: names of the layers ``layer_start .. layer_end - 1``.
    """

    index: int
    layer_start: int
    layer_end: int
    device_index: int
    device_name: str
    memory_bytes: int
    capacity_bytes: int
    layer_names: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        """Layers in this stage."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete pipeline plan (see the module docstring for the terms).

    Lengths are in units of the sequence axis the model's inputs carry (:attr:`unit`): tokens
    for a language model, patch rows for a diffusion transformer whose latent's height is the
    sequence axis (``tokens_per_unit`` tokens each). ``tppc.plan`` and ``tppc.compile`` give
    the same units; a chunk is always a band of whole units.

    Attributes:
        workload: what one call computes.
        seq_len: units in the sequence.
        granularity: chunk sizes are multiples of this (units).
        boundaries: offsets ``(0, b_1, ..., seq_len)`` of the chunks (units).
        stages: the stages in pipeline order.
        start: ``start[s][j]`` predicted start (seconds) of job ``j`` on stage ``s``.
        end: ``end[s][j]`` predicted end.
        latency: predicted seconds for one call (the simulated makespan plus warm-up).
        warmup_seconds: part of ``latency`` spent in synchronous warm-up steps.
        lower_bound: ``max(lower_bound_work, lower_bound_path)``.
        lower_bound_work: over every placement, the least busiest-stage time: the first
            chunk reaching the stage, its one-chunk work, the last chunk leaving it
            (:mod:`tppc.planner.bounds`); at least serial time / number of stages.
        lower_bound_path: time for the last ``granularity`` tokens to cross every layer
            (at least one read of every weight).
        solver: provenance of the plan's solve.
        split: the certified split search for this placement (``None`` when not run).
        tokens_per_unit: tokens in one unit of the sequence axis (1: the unit is a token; a
            DiT's patch columns: the unit is a patch row). Every time in the plan is priced
            on tokens.
    """

    workload: Workload
    seq_len: int
    granularity: int
    boundaries: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    latency: float
    warmup_seconds: float
    lower_bound: float
    lower_bound_work: float
    lower_bound_path: float
    solver: SolverInfo
    notes: tuple[str, ...] = field(default=())
    split: SplitSearch | None = None
    tokens_per_unit: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tokens_per_unit, bool) or not isinstance(self.tokens_per_unit, int) \
                or self.tokens_per_unit < 1:
            raise PlanError(f"Plan.tokens_per_unit={self.tokens_per_unit!r} must be an integer "
                            "≥ 1 (tokens in one unit of the sequence axis)")

    @property
    def unit(self) -> str:
        """What :attr:`seq_len`, :attr:`boundaries` and :attr:`granularity` count:
        ``"tokens"`` or ``"rows of N tokens"``."""
        n = self.tokens_per_unit
        return "tokens" if n == 1 else f"rows of {n} tokens"

    @property
    def seq_tokens(self) -> int:
        """Tokens in the sequence (``seq_len * tokens_per_unit``)."""
        return self.seq_len * self.tokens_per_unit

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """Chunks as ``(start, end)`` ranges of units."""
        return tuple(itertools.pairwise(self.boundaries))

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Chunk sizes in units (:attr:`unit`)."""
        return tuple(b - a for a, b in self.chunks)

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def ratio_to_bound(self) -> float:
        """``latency / lower_bound`` (1.0 would be perfect)."""
        return self.latency / self.lower_bound if self.lower_bound > 0 else float("inf")

    def to_json(self) -> str:
        """Serialise to JSON (with ``"schema": PLAN_SCHEMA``)."""
        data: dict[str, Any] = {"schema": PLAN_SCHEMA, **asdict(self)}
        return json.dumps(data, indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`.

        Schema 1 (no ``tokens_per_unit``) is read with ``tokens_per_unit=1``.

        Raises:
            PlanError: when the schema tag is missing or neither :data:`PLAN_SCHEMA` nor 1.
        """
        data = json.loads(text)
        schema = data.pop("schema", None)
        if schema not in _READS:
            raise PlanError(
                f"plan.json has schema {schema!r}, this tppc reads {list(_READS)}; "
                "re-plan with this version"
            )
        stages = tuple(
            StagePlan(**{**s, "layer_names": tuple(s["layer_names"])}) for s in data["stages"]
        )
        return cls(
            **{
                **data,
                "workload": Workload(**data["workload"]),
                "boundaries": tuple(data["boundaries"]),
                "stages": stages,
                "start": tuple(tuple(r) for r in data["start"]),
                "end": tuple(tuple(r) for r in data["end"]),
                "solver": SolverInfo(**data["solver"]),
                "notes": tuple(data["notes"]),
                "split": SplitSearch(**data["split"]) if data.get("split") else None,
            }
        )

    def summary(self) -> str:
        """A readable table of the plan (stages, memory, busy time, chunks, solver)."""
        w = self.workload
        steps = (
            "" if w.kind != "diffusion" else f", {w.steps} steps ({w.warmup_steps} warm-up)"
        )
        s = self.solver
        lines = [
            f"tppc plan: {w.kind}{steps}, seq_len={self.seq_len} {self._in_units()}, "
            f"granularity {self.granularity}, {self.num_stages} stages, "
            f"{len(self.boundaries) - 1} chunks",
            f"predicted latency {_ms(self.latency)}   lower bound {_ms(self.lower_bound)} "
            f"(work {_ms(self.lower_bound_work)}, path {_ms(self.lower_bound_path)})   "
            f"ratio {self.ratio_to_bound:.3f}",
            f"solver {s.solver}: {s.status}, objective {_ms(s.objective)}, gap "
            f"{100 * s.gap:.2f}%, {s.seconds:.2f} s" + (f"  [{s.detail}]" if s.detail else ""),
            *([f"split {self.split.method}: {self.split.status}, bound for this placement "
               f"{_ms(self.split.bound)}, gap {100 * self.split.gap:.2f}%, "
               f"{self.split.seconds:.2f} s"] if self.split else []),
            "",
            f"{'stage':>5}  {'device':<12} {'layers':<12} {'memory used / capacity':<24} "
            f"{'busy':>10}",
        ]
        for st in self.stages:
            busy = sum(e - b for b, e in zip(self.start[st.index], self.end[st.index]))
            mem = f"{st.memory_bytes / 1e9:.2f} / {st.capacity_bytes / 1e9:.2f} GB"
            rng = f"[{st.layer_start}, {st.layer_end})"
            lines.append(f"{st.index:>5}  {st.device_name:<12} {rng:<12} {mem:<24} {_ms(busy):>10}")
        lines += ["", f"chunks ({self.unit}): " + " ".join(str(c) for c in self.chunk_sizes)]
        inside = [st.layer_names[0] for st in self.stages[1:]
                  if st.layer_names and st.layer_names[0].endswith((".mlp", ".attn", ".part1"))]
        if inside:  # layer indices count the parts of the blocks cut at their waist
            lines.append("stage boundaries inside a block: " + ", ".join(
                f"before {name}" for name in inside))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _in_units(self) -> str:
        if self.tokens_per_unit == 1:
            return "tokens"
        return f"{self.unit} ({self.seq_tokens} tokens)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def say_expired(plan: Plan, deadline: float) -> Plan:
    """``plan``, its solver status ``"time_limit"`` when it ends after ``deadline``
    (``time.perf_counter``) without a proven optimum: a phase was cut short or skipped."""
    if time.perf_counter() <= deadline or plan.solver.status in ("optimal", "time_limit"):
        return plan
    solver = dataclasses.replace(plan.solver, status="time_limit",
                                 detail=f"{plan.solver.detail}; stopped by the time limit")
    return dataclasses.replace(plan, solver=solver)

