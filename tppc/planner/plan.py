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
from typing import Any

from tppc.errors import PlanError
from tppc.planner.choice import HybridChoice
from tppc.planner.provenance import SolverInfo, SplitSearch
from tppc.planner.summary import plan_summary
from tppc.planner.workload import Workload

__all__ = ["PLAN_SCHEMA", "Plan", "SolverInfo", "SplitSearch", "StagePlan", "Workload",
           "say_expired", "unit_text"]

PLAN_SCHEMA = "tppc.plan/6"
"""Schema tag written by :meth:`Plan.to_json`; bumped on incompatible changes (2: the unit,
``tokens_per_unit``; 3: tensor-parallel groups, ``replicas``, ``degrees``, ``choice``; 4: the
stages' ``cfg_parallel``, ``ulysses`` and ``ring``; 5: the stages' ``intra_op``; 6: ``blocks``,
a unit that is a block scan's block). :meth:`Plan.from_json` also reads schemas 1 (plans count
tokens), 2 (one device a stage), 3 (tensor parallelism only), 4 (no intra-op stages) and 5
(a unit of several tokens is a patch row)."""

_READS = ("tppc.plan/1", "tppc.plan/2", "tppc.plan/3", "tppc.plan/4", "tppc.plan/5",
          PLAN_SCHEMA)


def unit_text(tokens_per_unit: int, blocks: bool = False) -> str:
    """What a length in units counts, in words: ``"tokens"``, ``"patch rows of N tokens"``
    (a DiT's latent rows) or ``"blocks of N tokens"`` (a block capture's scan blocks)."""
    if tokens_per_unit == 1 and not blocks:
        return "tokens"
    return f"{'blocks' if blocks else 'patch rows'} of {tokens_per_unit} tokens"


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
        index: stage number (0 is the first).
        layer_start: first layer (inclusive).
        layer_end: last layer (exclusive).
        device_index: position of the device in the cluster chain.
        device_name: the device's preset name.
        memory_bytes: predicted peak memory of one device of the stage (weights + K/V
            buffers + in-flight activations; its shard under tensor parallelism).
        capacity_bytes: the device's usable memory.
        layer_names: names of the layers ``layer_start .. layer_end - 1``.
        tensor_parallel: devices that run the stage together, each a ``1/t`` shard of its
            cut nodes (1: the whole stage on one device).
        cfg_parallel: copies of the stage group that each run ``1/c`` of the call's batch
            (classifier-free guidance: the two halves of a guided batch).
        ulysses: devices that each hold ``1/u`` of the tokens, exchanging tokens for heads
            around each attention (all-to-all).
        ring: devices that each hold ``1/r`` of the tokens, passing K/V around the group.
        device_indices: the stage's devices (cluster positions), ``device_index`` first, in
            worker order (:class:`tppc.program.mesh.Mesh`: cfg, ring, ulysses, tensor, the
            last fastest): :attr:`group_size` of them; with one always ``(device_index,)``.
        intra_op: CPU devices of one machine whose cores each worker of the stage runs
            as its intra-op threads (torch splits every op across them; no collectives):
            ``intra_op`` consecutive devices per worker. 1: a worker on one device's share.
            Only with ``tensor_parallel = 1``: one worker, or a diffusion transformer's CFG,
            Ring or Ulysses workers, each of ``intra_op`` devices (worker ``r`` on
            ``device_indices[r·intra_op : (r+1)·intra_op]``).
    """

    index: int
    layer_start: int
    layer_end: int
    device_index: int
    device_name: str
    memory_bytes: int
    capacity_bytes: int
    layer_names: tuple[str, ...] = ()
    tensor_parallel: int = 1
    device_indices: tuple[int, ...] = ()
    cfg_parallel: int = 1
    ulysses: int = 1
    ring: int = 1
    intra_op: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "cfg_parallel", "ulysses", "ring", "intra_op"):
            d = getattr(self, name)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise PlanError(f"StagePlan {self.index}: {name}={d!r} must be an integer "
                                ">= 1 (devices that run the stage together)")
        if self.intra_op > 1 and self.tensor_parallel > 1:
            raise PlanError(f"StagePlan {self.index}: intra_op={self.intra_op} with "
                            f"{self.mesh_label}: an intra-op worker's threads split each op "
                            "of the whole stage, a tensor-parallel worker holds a shard. fix: "
                            "intra_op=1, or tensor_parallel=1")
        n = self.group_size
        if n == 1:  # one device: always the stage's own (a replaced device_index moves it)
            object.__setattr__(self, "device_indices", (self.device_index,))
            return
        indices = tuple(self.device_indices)
        object.__setattr__(self, "device_indices", indices)
        if len(indices) != n or len(set(indices)) != n or indices[0] != self.device_index:
            raise PlanError(
                f"StagePlan {self.index}: device_indices={indices} must name "
                f"{n} distinct devices ({self.mesh_label}), device_index={self.device_index} "
                "first. fix: replace device_index and device_indices together")

    @property
    def workers(self) -> int:
        """Workers that run the stage: ``cfg_parallel * ring * ulysses * tensor_parallel``."""
        return self.cfg_parallel * self.ring * self.ulysses * self.tensor_parallel

    @property
    def group_size(self) -> int:
        """Devices that run the stage: :attr:`workers` ``* intra_op``."""
        return self.workers * self.intra_op

    @property
    def mesh_label(self) -> str:
        """The degrees above 1, e.g. ``"CFG2 x Ulysses2 x TP2"`` or ``"IntraOp2"`` (``"1
        device"`` for one)."""
        parts = [f"{label}{d}" for label, d in (("CFG", self.cfg_parallel), ("Ring", self.ring),
                                                ("Ulysses", self.ulysses),
                                                ("TP", self.tensor_parallel),
                                                ("IntraOp", self.intra_op)) if d > 1]
        return " x ".join(parts) or "1 device"

    @property
    def devices_label(self) -> str:
        """``"h100-sxm"``, or for a group ``"h100-sxm TP4 (devices 0-3)"`` (charts, traces)."""
        if self.group_size == 1:
            return self.device_name
        ids = self.device_indices
        return f"{self.device_name} {self.mesh_label.replace(' x ', 'x')} " \
               f"(devices {ids[0]}-{ids[-1]})"

    @property
    def num_layers(self) -> int:
        """Layers in this stage."""
        return self.layer_end - self.layer_start


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete pipeline plan (see the module docstring for the terms).

    Lengths are in units of the sequence axis the model's inputs carry (:attr:`unit`): tokens
    for a language model, patch rows for a diffusion transformer whose latent's height is the
    sequence axis, blocks for a block capture (a model that pads its sequence to whole blocks
    of a scan, :mod:`tppc.frontend.block_capture`); ``tokens_per_unit`` tokens each.
    ``tppc.plan`` and ``tppc.compile`` give the same units; a chunk is always a band of whole
    units.

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
        blocks: the unit is a block of ``tokens_per_unit`` tokens of a block scan
            (``ctx.block_size``), not a patch row.
        replicas: copies of the whole pipeline the cluster runs side by side (devices left
            over by one pipeline); ``latency`` is one call on one of them.
        choice: the hybrid search behind the degrees (:class:`HybridChoice`; ``None`` for a
            plan of one device per stage planned without it).
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
    replicas: int = 1
    choice: HybridChoice | None = None
    blocks: bool = False

    def __post_init__(self) -> None:
        for name in ("cfg_parallel", "ulysses", "ring"):
            seen = {getattr(st, name) for st in self.stages}
            if len(seen) > 1:
                raise PlanError(f"Plan: the stages' {name} degrees differ ({sorted(seen)}); "
                                "every stage must cut the batch and the tokens alike. fix: "
                                f"one {name} for every stage")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) \
                or self.replicas < 1:
            raise PlanError(f"Plan.replicas={self.replicas!r} must be an integer >= 1")
        if isinstance(self.tokens_per_unit, bool) or not isinstance(self.tokens_per_unit, int) \
                or self.tokens_per_unit < 1:
            raise PlanError(f"Plan.tokens_per_unit={self.tokens_per_unit!r} must be an integer "
                            "≥ 1 (tokens in one unit of the sequence axis)")
        if self.blocks and self.tokens_per_unit == 1:
            raise PlanError("Plan.blocks=True with tokens_per_unit=1: a block scan's unit is a "
                            "block of k > 1 tokens. fix: tokens_per_unit=k (ctx.block_size)")

    @property
    def unit(self) -> str:
        """What :attr:`seq_len`, :attr:`boundaries` and :attr:`granularity` count:
        ``"tokens"``, ``"patch rows of N tokens"`` or ``"blocks of N tokens"``
        (:func:`unit_text`)."""
        return unit_text(self.tokens_per_unit, self.blocks)

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
    def degrees(self) -> dict[str, Any]:
        """The chosen degrees by keyword: ``{"num_stages": n, "tensor_parallel": t (or a
        tuple per stage when they differ), "cfg_parallel": c, "ulysses": u, "ring": r,
        "intra_op": i (or a tuple per stage), "replicas": k}``."""
        tps = tuple(st.tensor_parallel for st in self.stages)
        tp: int | tuple[int, ...] = tps[0] if tps and len(set(tps)) == 1 else tps
        ios = tuple(st.intra_op for st in self.stages)
        io: int | tuple[int, ...] = ios[0] if len(set(ios)) == 1 else (ios or 1)
        first = self.stages[0] if self.stages else StagePlan(
            index=0, layer_start=0, layer_end=0, device_index=0, device_name="",
            memory_bytes=0, capacity_bytes=0)
        return {"num_stages": self.num_stages, "tensor_parallel": tp,
                "cfg_parallel": first.cfg_parallel, "ulysses": first.ulysses,
                "ring": first.ring, "intra_op": io, "replicas": self.replicas}

    @property
    def num_devices(self) -> int:
        """Devices the plan runs on: every stage's group, times the replicas."""
        return self.replicas * sum(st.group_size for st in self.stages)

    @property
    def ratio_to_bound(self) -> float:
        """``latency / lower_bound`` (1.0 would be perfect)."""
        return self.latency / self.lower_bound if self.lower_bound > 0 else float("inf")

    def to_json(self) -> str:
        """Serialise to JSON (with ``"schema": PLAN_SCHEMA``)."""
        data: dict[str, Any] = {"schema": PLAN_SCHEMA, **asdict(self), "degrees": self.degrees}
        return json.dumps(data, indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`.

        Schema 1 (no ``tokens_per_unit``) is read with ``tokens_per_unit=1``; schemas 1 and 2
        (no groups) with one device a stage and one replica; schemas 1 to 5 with
        ``blocks=False``. ``degrees`` is derived, not read.

        Raises:
            PlanError: when the schema tag is missing or neither :data:`PLAN_SCHEMA` nor 1.
        """
        data = json.loads(text)
        schema = data.pop("schema", None)
        data.pop("degrees", None)
        if schema not in _READS:
            raise PlanError(
                f"plan.json has schema {schema!r}, this tppc reads {list(_READS)}; "
                "re-plan with this version"
            )
        stages = tuple(
            StagePlan(**{**s, "layer_names": tuple(s["layer_names"]),
                         "device_indices": tuple(s.get("device_indices", ()))})
            for s in data["stages"]
        )
        choice = data.get("choice")
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
                "choice": None if choice is None else HybridChoice(**{
                    **choice, "infeasible": tuple(choice["infeasible"]),
                    "collectives": tuple(choice["collectives"])}),
            }
        )

    def summary(self) -> str:
        """A readable table of the plan: stages with their devices and degree, memory, busy
        time, chunks, solver; with tensor parallelism the collectives per layer and why this
        configuration beat the runner-up (:func:`tppc.planner.summary.plan_summary`)."""
        return plan_summary(self)


def say_expired(plan: Plan, deadline: float) -> Plan:
    """``plan``, its solver status ``"time_limit"`` when it ends after ``deadline``
    (``time.perf_counter``) without a proven optimum: a phase was cut short or skipped."""
    if time.perf_counter() <= deadline or plan.solver.status in ("optimal", "time_limit"):
        return plan
    solver = dataclasses.replace(plan.solver, status="time_limit",
                                 detail=f"{plan.solver.detail}; stopped by the time limit")
    return dataclasses.replace(plan, solver=solver)
