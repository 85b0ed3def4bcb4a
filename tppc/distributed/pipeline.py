"""A pipeline over processes: one rank per worker, each holding only its own shard's weights.

Terms:
    job: ``W`` processes started together, rank ``r`` running worker ``r`` of the program
        (:mod:`tppc.distributed.job`: joining it, its size against the plan's).
    collective call: every rank calls the pipeline together (SPMD, like any torch.distributed
        program). Rank 0's inputs are used: it validates them before any communication and
        broadcasts them (or its error, which every rank then raises); the results come back
        on rank 0 (``results="rank0"``, the others get None) or on every rank (``"all"``).
    materialised stage: each rank captures the model (built on the meta device: no weights)
        and plans (rank 0 plans, the plan is broadcast as JSON), builds the program on the
        meta device, then loads only its own stage's tensors from a safetensors checkpoint
        (:class:`tppc.distributed.checkpoint.StageWeights`); a shard, only its parts of them.

``generate`` and ``denoise`` (DiT, :mod:`tppc.distributed.denoise`) step the same
loop on every rank; the leader (the first worker of the last stage) sends what stage 0
needs next (tokens, stepped patches).
An ahead-of-time export directory would replace capture and
planning by reading ``plan.json`` and the stage files: only :meth:`DistributedPipeline.materialise` reads weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from tppc.backends import wire
from tppc.backends.torch_distributed import DistributedExecutor
from tppc.calls.call import run_call
from tppc.distributed.checkpoint import StageWeights
from tppc.distributed.job import DEGREES, check_world, group_degree, init_distributed, stages_for
from tppc.distributed.rank_delivery import RankDelivery
from tppc.distributed.rank_threads import set_rank_threads
from tppc.distributed.validate import retarget, validate_on_rank0
from tppc.driver.emit import Emitter
from tppc.driver.options import CompileOptions, check_seconds
from tppc.driver.planning import Planner, example_plan
from tppc.errors import RuntimeInputError, SpecError, StageFailed, TppcError
from tppc.frontend.front_end import FrontEnd, capture_front_end
from tppc.passes.sharding.shard_graph import PARTS_OF
from tppc.pipeline.compiled import CompiledPipeline
from tppc.planner.plan import Plan
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call

__all__ = ["DistributedPipeline", "check_world", "compile_distributed", "init_distributed"]

Results = Literal["rank0", "all"]


def compile_distributed(model: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: Mapping[str, Any] | None = None, *, plan: Plan | None = None,
                        seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
                        checkpoint: str | None = None,
                        buffers: Mapping[str, torch.Tensor] | None = None,
                        results: Results = "rank0", comm_timeout: float = 60.0,
                        device: str = "auto", **options: Any) -> DistributedPipeline:
    """``tppc.compile(..., backend="distributed")``: see the module docstring.

    Args:
        model: the model, on the meta device (see :func:`tppc.distributed.checkpoint.empty_model`)
            or real (then, without a checkpoint, every rank copies its stage from it).
        checkpoint: safetensors file of the model's weights.
        buffers: real buffers of an empty model (``empty_model``'s fourth result).
        results: ``"rank0"`` or ``"all"``: who gets the outputs.
        comm_timeout: seconds a rank waits for a peer before it fails (bounded failure).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        **options: :class:`CompileOptions` fields (``verify``: rank 0 checks the program
            before the stages load, :mod:`tppc.distributed.validate`; ``num_stages``
            defaults to the job's size divided by the degrees given (``tensor_parallel``,
            a tuple: one stage per degree; ``cfg_parallel``, ``ulysses``, ``ring``) and, with
            none given, to the job's size for a causal model, while a diffusion
            transformer's planner chooses the mix of degrees and stages with a worker on
            every rank; ``cluster`` defaults to ``"<W>xcpu"``; ``devices`` and ``executor``
            are set here; ``intra_op`` is 1: a plan with intra-op stages is refused).

    Raises:
        SpecError: the job's size is not the plan's worker count (the message names both).
    """
    if results not in ("rank0", "all"):
        raise SpecError(f"results={results!r}; use 'rank0' or 'all'")
    if options.get("intra_op") not in (None, 1) or (
            plan is not None and any(st.intra_op > 1 for st in plan.stages)):
        raise SpecError(f"intra_op={options.get('intra_op', plan and plan.degrees['intra_op'])}"
                        ": the distributed backend runs one worker per rank and one rank per "
                        "device; a worker of several CPU devices' intra-op threads is run by "
                        "the threads and local executors. fix: backend='torch' with "
                        "executor='threads', or intra_op=1 (a plan planned so)")
    options["intra_op"] = 1  # the planner must give every rank a device of its own
    rank, world, where = init_distributed(comm_timeout, device)
    options.setdefault("cluster", f"{world}xcpu")
    chooses = "num_stages" not in options and all(options.get(name) is None for name in DEGREES)
    if not chooses:
        options.setdefault("num_stages", stages_for(world, options.get("tensor_parallel"),
                                                    group_degree(options)))
    options.update(executor="distributed", devices=("meta",) * world)
    opts = CompileOptions.from_kwargs(**options)
    set_rank_threads(opts, rank, where)  # capture and planning too (stage not known yet)
    front = capture_front_end(model, args, kwargs, seq_dims=seq_dims)  # on meta if the model is
    if chooses and not front.bidirectional:  # an LLM: one stage a rank
        opts = dataclasses.replace(opts, num_stages=world)
    plan, planner = example_plan(front, opts, plan,
                                 share=lambda planner: _shared_planner(planner, rank))
    validation = None
    if opts.verify:  # rank 0 checks the program before any rank loads its stage
        validation = validate_on_rank0(model, front, plan, opts, args, kwargs,
                                       checkpoint=checkpoint, buffers=dict(buffers or {}),
                                       device=where, rank=rank)
    weights = StageWeights(checkpoint, model, dict(buffers or {}), where)
    emitter = Emitter(opts, planner, None if planner is not None else plan)
    emitter.check(front, plan)
    program = emitter.emit(front, plan)
    check_world(program, world)
    set_rank_threads(opts, program.runners[rank].index, where)
    cp = DistributedPipeline(model, front, program, emitter,
                             seq_dims=seq_dims, weights=weights, rank=rank, world=world,
                             results=results, comm_timeout=comm_timeout)
    cp.validation, cp.example = validation, (tuple(args), dict(kwargs or {}))
    return cp


class DistributedPipeline(CompiledPipeline):
    """This rank's share of a pipeline; call it on every rank together (module docstring).

    Attributes:
        rank: this process's rank (= its worker; its stage without tensor parallelism).
        world: number of ranks (= workers).
        device: this rank's device.
        weights: this rank's loaded tensors (``weights.nbytes``).
        comm: this rank's :class:`tppc.backends.torch_distributed.DistributedExecutor`.
    """

    REBALANCE_REFUSAL = ("a distributed pipeline cannot rebalance: every rank holds only its "
                         "stage's weights, and moving layers would reload them on every rank "
                         "at once. fix: re-plan and launch the job again (tppc.plan)")

    def __init__(self, model: torch.nn.Module, front: FrontEnd, program: Program,
                 emitter: Emitter, *, seq_dims: Mapping[str, int | tuple[int, ...]] | None,
                 weights: StageWeights, rank: int, world: int, results: Results,
                 comm_timeout: float) -> None:
        self.rank, self.world, self.results = rank, world, results
        self.device, self.weights = weights.device, weights
        self.comm_timeout = comm_timeout
        self.comm = DistributedExecutor(rank, world, emitter.options.queue_depth, comm_timeout)
        super().__init__(model, front, program, emitter, seq_dims=seq_dims)

    @property
    def last_trace(self) -> list[tuple[int, int, float, float]]:
        """``(stage, chunk, start, end)`` of this rank's jobs in the last call."""
        return self.comm.last_trace

    def run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None, *,
            timeout: float | None = None, executor: Any = None,
            trace: list | None = None) -> Any:
        """``model(*args, **kwargs)`` through the job (collective; rank 0's inputs); the
        outputs on rank 0 (every rank with ``results="all"``), None elsewhere.

        Raises:
            StageTimeout: the call outlived ``timeout`` (default ``options.timeout``), rank
                0's wait for the results included.
        """
        check_seconds("timeout", timeout)
        timeout = self.options.timeout if timeout is None else timeout
        args, kwargs = self.share_inputs("call", (tuple(args), dict(kwargs or {})))
        return run_call(self, args, kwargs, self._delivery(timeout), timeout=timeout,
                        trace=trace)

    def generate(self, input_ids: torch.Tensor | None = None, max_new_tokens: int = 20,
                 **kwargs: Any) -> torch.Tensor | None:
        """Greedy generation through the job (collective; rank 0's ``input_ids``).

        Every rank steps the same loop; the last rank picks each token and broadcasts it.
        Returns prompt + new tokens (see :func:`tppc.pipeline.generate.greedy_generate`).
        """
        from tppc.distributed.generate import distributed_generate

        return distributed_generate(self, input_ids, max_new_tokens, **kwargs)

    def denoise(self, latents: torch.Tensor | None, scheduler: Any,
                num_inference_steps: int = 20, **kwargs: Any) -> torch.Tensor | None:
        """PipeFusion denoising through the job (collective; rank 0's latents; every rank
        passes its scheduler); see :mod:`tppc.distributed.denoise`."""
        from tppc.distributed.denoise import distributed_denoise

        kwargs.pop("executor", None)  # always the job
        return distributed_denoise(self, latents, scheduler, num_inference_steps, **kwargs)

    def execute(self, program: Program, call: Call, state: Any, sink: Any = None,
                executor: Any = None, timeout: float | None = None,
                trace: list | None = None) -> list[tuple[Any, ...]]:
        """This rank's stage of ``call`` (``executor`` is ignored: always the job); a call
        longer than ``timeout`` (default ``options.timeout``) raises StageTimeout."""
        timeout = self.options.timeout if timeout is None else timeout
        return self.comm.run(program, call, state, sink, timeout=timeout, trace=trace)

    # -- collective helpers (used by generate and denoise) -----------------------------------------
    def share_generate(self, input_ids: Any, max_new_tokens: int) -> tuple[Any, int]:
        """Rank 0's ``(input_ids, max_new_tokens)`` on every rank (validated on rank 0)."""
        def check(value: tuple[Any, int]) -> None:
            self.bind((value[0],), {})
            if isinstance(value[1], bool) or not isinstance(value[1], int) or value[1] < 1:
                raise RuntimeInputError(f"max_new_tokens={value[1]!r} must be an integer ≥ 1")

        return self.share_inputs("generate", (input_ids, max_new_tokens), check)

    def broadcast_token(self, token: torch.Tensor | None, like: torch.Tensor,
                        src: int | None = None) -> torch.Tensor:
        """Rank ``src``'s ``token`` (shaped like ``like``) on every rank (default: the last
        rank; the program's leader with tensor-parallel stages)."""
        src = self.world - 1 if src is None else src
        buf = (token if token is not None else torch.empty_like(like)).to(self.device)
        self.collective(lambda: dist.broadcast(buf, src=src), "token broadcast")
        return buf.to(like.device)

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (as many on each), in rank order, on every rank."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        self.collective(lambda: dist.all_gather(rows, mine), "memory check")
        return [row.tolist() for row in rows]

    def share_inputs(self, what: str, value: Any, check: Any = None) -> Any:
        """Rank 0's ``value`` on every rank (in the wire format), after rank 0 validated it
        with ``check(value)`` (default: ``bind(*value)``); rank 0's error on every rank."""
        message: dict[str, Any] | None = None
        error: TppcError | None = None
        if self.rank == 0:
            try:
                if check is not None:
                    check(value)
                else:
                    self.bind(*value)
                message = {"ok": value}
                wire.encode(message)  # refuses what cannot travel, before anything is sent
            except TppcError as exc:
                error, message = exc, {"error": f"{type(exc).__name__}: {exc}"}
        message = self.collective(lambda: wire.broadcast(message, 0, self.device),
                                  f"{what} inputs")
        if "error" in message:
            if error is not None:
                raise error
            raise RuntimeInputError(f"rank 0 refused the {what} inputs: {message['error']}")
        return message["ok"]

    def collective(self, op: Callable[[], Any], what: str) -> Any:
        """``op()``, a communication of ``what``: its failure raised as ``StageFailed``."""
        return self.comm.guard(op, what)

    # -- building -----------------------------------------------------------------------------
    def _delivery(self, timeout: float | None = None) -> RankDelivery:
        return RankDelivery(self.rank, self.world, self.results, self.device, self.comm,
                            self.collective, timeout)

    def _admit(self, program: Program) -> Program:
        """An emitted (meta) program with this rank's stage loaded."""
        self._executors.setdefault("distributed", self.comm)
        return self.materialise(super()._admit(program))

    def materialise(self, program: Program) -> Program:
        """The meta program with this rank's worker (and tail, on the leader) loaded."""
        mine = self._load(program.runners[self.rank])
        tail = program.tail
        if tail is not None and self.rank == program.leader:
            self.weights.materialise(tail)
            retarget(tail, self.device)
        if not program.workers:
            stages = list(program.stages)
            stages[self.rank] = mine
            return dataclasses.replace(program, stages=tuple(stages), tail=tail)
        workers = list(program.workers)
        workers[self.rank] = mine
        stages = tuple(next(w for w in workers if w.index == s)
                       for s in range(len(program.stages)))
        return dataclasses.replace(program, stages=stages, workers=tuple(workers), tail=tail)

    def _load(self, stage: StageProgram) -> StageProgram:
        """``stage`` (a stage, or a shard: its parts) with its tensors loaded on this device."""
        if not stage.parts:
            return self._load_graph(stage)
        parts = tuple(self._load_graph(p, stage.module.meta.get(PARTS_OF, {}))
                      for p in stage.parts)
        params = {id(t): t for p in parts for t in p.module.parameters()}
        tensors = {**params, **{id(t): t for p in parts for t in p.module.buffers()}}
        return dataclasses.replace(
            stage, device=self.device, parts=parts, positional=parts[0].positional,
            param_count=sum(t.numel() for t in params.values()),
            param_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def _load_graph(self, stage: StageProgram, parts: Any = None) -> StageProgram:
        modules = [stage.module] + ([stage.runnable] if stage.runnable is not stage.module
                                    else [])
        self.weights.materialise(*modules, parts=parts)
        for module in modules:
            retarget(module, self.device)
        tensors = [*stage.module.parameters(), *stage.module.buffers()]
        return dataclasses.replace(
            stage, device=self.device, positional=stage.module.tppc_positional,
            param_count=sum(p.numel() for p in stage.module.parameters()),
            param_bytes=sum(t.numel() * t.element_size() for t in tensors))


def _shared_planner(planner: Planner, rank: int) -> Planner:
    """Rank 0 plans; every rank gets the plan (JSON) or rank 0's error."""
    def plan_length(front: FrontEnd, length: int, workload: Any = None) -> Plan:
        box: list[Any] = [None]
        if rank == 0:
            try:
                plan = planner(front, length) if workload is None else planner(
                    front, length, workload=workload)
                box[0] = ("ok", plan.to_json())
            except TppcError as exc:
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        try:
            box[0] = wire.broadcast(box[0], 0)
        except Exception as exc:
            raise StageFailed(f"rank 0 did not share the plan for {length} tokens: {exc}. "
                              "fix: see rank 0's log") from exc
        if box[0][0] == "error":
            raise SpecError(f"planning {length} tokens on rank 0 failed: {box[0][1]}")
        return Plan.from_json(box[0][1])

    return plan_length
