"""Emit: partition a chunk-step graph by a plan, place each stage, let the last stage write
its outputs in place (:mod:`tppc.passes.stages.direct_output`): a
:class:`~tppc.program.program.Program`.

Terms:
    emitter: what a pipeline is given to get the program of a length it has not run yet
        (:class:`Emitter`): the plan of that length (re-planned when tppc made the plan,
        refused when it was given), its chunks, then :func:`build_program`. The pipeline
        holds the programs; it never plans or emits itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from tppc.cost_models.cluster import cpu_device_count
from tppc.driver.options import CompileOptions, chunk_bounds
from tppc.errors import RuntimeInputError, SpecError
from tppc.ir.context import CompileContext
from tppc.ir.records import CHUNK_INPUT, CHUNK_SIGNATURE, STAGE_INFO, ChunkSignature, StageInfo
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.passes.runner import run_passes
from tppc.passes.sharding.shard_graph import cuttable, shard_graph
from tppc.passes.sharding.split_parts import split_parts
from tppc.passes.stages.direct_output import write_outputs_in_place, write_piece_in_place
from tppc.passes.stages.partition_stages import partition_stages
from tppc.passes.stages.place_constructors import place_constructors
from tppc.passes.subgraph import copy_graph
from tppc.planner.plan import Plan, StagePlan
from tppc.program.cores import cores_per_device
from tppc.program.mesh import AXES, Mesh
from tppc.program.program import BufferSpec, Program, StageProgram
from tppc.program.schedule import flow_shop
from tppc.program.sharded import mesh_groups

if TYPE_CHECKING:
    from tppc.driver.planning import Planner
    from tppc.frontend.front_end import FrontEnd

__all__ = ["Emitter", "WorkerCut", "build_program", "device_for", "mesh_stage", "sharded_stage",
           "worker_threads"]

WorkerCut = Callable[[fx.GraphModule, Mesh, int, str], fx.GraphModule]
"""``cut(stage graph, mesh, rank, what)``: worker ``rank``'s graph of a stage on ``mesh``,
with collective marks (every call-fed input whole, narrowed by the graph itself; boundary
values cut by cfg, ring and ulysses; the last stage's outputs whole); ``what`` names the stage
in errors."""


@dataclass(frozen=True)
class Emitter:
    """The programs of a compiled model, one per (capture, length) (module docstring).

    Attributes:
        options: the compile options (``chunks``, ``devices``).
        planner: the planner of every length, or None: ``given`` is run as is.
        given: the plan given to compile (None when tppc plans).
    """

    options: CompileOptions
    planner: Planner | None
    given: Plan | None = None

    def __call__(self, front: FrontEnd, length: int) -> Program:
        """The program of ``length`` tokens on ``front``'s capture."""
        return self.emit(front, self.plan(front, length))

    def plan(self, front: FrontEnd, length: int) -> Plan:
        """The plan of ``length`` tokens: re-planned, or the given one.

        Raises:
            RuntimeInputError: a length other than the given plan's.
        """
        if self.planner is not None:
            return self.planner(front, length)
        assert self.given is not None, "an emitter needs a planner or a given plan"
        if length != self.given.seq_len:
            raise RuntimeInputError(
                f"the sequence has {length} tokens; the given plan is for "
                f"{self.given.seq_len}. fix: call with {self.given.seq_len} tokens, or "
                "compile with plan=None so that tppc re-plans per length")
        return self.given

    def emit(self, front: FrontEnd, plan: Plan) -> Program:
        """``plan``'s program: its chunks (one where attention is bidirectional; the option's
        on a given plan), then :func:`build_program`."""
        chunks = plan.chunks
        if front.bidirectional:  # a barrier at every layer: one chunk, exact
            chunks = ((0, plan.seq_len),)
        elif self.options.chunks is not None and self.planner is None:
            bounds = chunk_bounds(self.options.chunks, plan.seq_len)
            chunks = tuple(itertools.pairwise(bounds))
        return build_program(front.chunk, front.ctx, plan, chunks, self.options.devices,
                             cpu_devices=cpu_device_count(self.options.cluster))

    def check(self, front: FrontEnd, plan: Plan) -> None:
        """Refuse chunks on a model whose attention is bidirectional (before emitting).

        Raises:
            SpecError: ``chunks=`` or a given plan of many chunks on such a model.
        """
        chunks = self.options.chunks
        many = (chunks is not None and (chunks != 1 if isinstance(chunks, int)
                                        else len(chunks) > 2))
        given_many = (self.planner is None and len(plan.boundaries) > 2
                      and plan.workload.kind != "diffusion")  # diffusion: denoise's patches
        if front.bidirectional and (many or given_many):
            raise SpecError(
                f"{front.ctx.model_name} has bidirectional attention or buffered mixing ("
                f"{front.bidirectional[0]}): a chunk would read stale rows of later "
                "chunks, so tppc runs each call as one chunk (exact). fix: drop chunks= / give "
                "a plan with one chunk (cp.denoise pipelines the patches)")


def build_program(chunk: fx.GraphModule, ctx: CompileContext, plan: Plan,
                  chunks: tuple[tuple[int, int], ...] | None = None,
                  devices: Sequence[str | torch.device] | None = None,
                  degrees: Sequence[int] | None = None, cut: WorkerCut | None = None,
                  ring_gather: str = "", cpu_devices: int = 0) -> Program:
    """Partition ``chunk`` (a chunk-step graph) by ``plan`` and place each stage.

    Every stage gets its own parameter tensors: on its device they alias the model's storage
    (nothing is copied or moved), on another device they are copies, so the user's model is
    never modified and tied weights used by two stages on two devices are duplicated.

    Args:
        chunk: output of ``chunk_attention_pass``.
        ctx: the compile context (``ctx.layers`` indexes the plan's layers).
        plan: placement and split; each stage's mesh of workers (``Mesh.of_stage``).
        chunks: the call's chunks (default: the plan's).
        devices: one torch device per stage (default: see :func:`device_for`).
        degrees: each stage's tensor-parallel degree (default: the plan's).
        cut: a stage graph's worker graph on a mesh with cfg, ring or ulysses above 1
            (:data:`WorkerCut`; default: :func:`worker_graph`).
        ring_gather: why a ring's attentions take the gather form (empty: Ring attention
            where it applies).
        cpu_devices: the CPU devices of the plan's cluster; each CPU worker runs its
            device's share of this machine's cores (``StageProgram.threads``:
            :func:`worker_threads`).
    """
    ranges = [(st.layer_start, st.layer_end) for st in plan.stages]
    names = [name for st in plan.stages for name in st.layer_names]
    graph = run_passes(chunk, ctx, [partition_stages(ranges, names)])
    signature: ChunkSignature = chunk.meta[CHUNK_SIGNATURE]
    meshes = tuple(Mesh.of_stage(st) for st in plan.stages)
    if degrees:
        meshes = tuple(dataclasses.replace(m, tp=d) for m, d in zip(meshes, degrees,
                                                                    strict=True))
    workers: list[StageProgram] = []
    for s, st in enumerate(plan.stages):
        module, device = getattr(graph, f"stage_{s}"), device_for(st, s, devices)
        workers.extend(mesh_stage(module, device, signature, meshes[s], s, cut, ring_gather)
                       if meshes[s].size > 1 else [_stage(module, device, signature)])
    workers = worker_threads(workers, cpu_devices,
                             tuple(st.intra_op for st in plan.stages))
    stages = tuple(next(w for w in workers if w.index == s) for s in range(len(plan.stages)))
    tail = getattr(chunk, "tppc_tail", None)
    if tail is not None:  # a copy with its own module tree (the chunk graph's stays as is)
        tail = _own_tensors(copy_graph(tail), stages[-1].device)
    chunks = chunks or plan.chunks
    many = any(m.size > 1 for m in meshes)
    tp_only = all(m.size == m.tp for m in meshes)
    stage_of = [w.index for w in workers]
    return Program(plan=plan, seq_len=plan.seq_len, chunks=chunks, stages=stages,
                   signature=signature, tail=tail, actions=flow_shop(chunks, len(stages)),
                   groups=mesh_groups(stage_of, () if tp_only else meshes) if many else (),
                   workers=tuple(workers) if many else (),
                   meshes=() if tp_only else meshes)


def worker_threads(workers: Sequence[StageProgram], cpu_devices: int = 0,
                   intra_op: Sequence[int] = ()) -> list[StageProgram]:
    """``workers`` with their intra-op threads: a CPU worker's device shares this machine's
    cores with the cluster's other CPU devices (``cpu_devices``; at least the program's
    CPU devices, as when ``devices=`` runs a GPU plan on this CPU), whatever torch's own
    thread count is; other workers keep torch's (``threads=None``). The worker of an
    intra-op stage (``intra_op[s] = k``: the plan's ``StagePlan.intra_op``) runs ``k``
    devices' shares.

    Example: a CFG-2 plan on ``"2xcpu"`` on 2 cores runs 1 thread in each of its 2 workers;
    an ``intra_op=2`` plan on ``"2xcpu"`` runs its one worker with 2 threads.
    """
    def k(w: StageProgram) -> int:
        return intra_op[w.index] if w.index < len(intra_op) else 1

    on_cpu = sum(k(w) for w in workers if w.device.type == "cpu")
    share = cores_per_device(max(cpu_devices, on_cpu))
    return [dataclasses.replace(w, threads=share * k(w) if w.device.type == "cpu" else None,
                                intra_op=k(w)) for w in workers]


def sharded_stage(module: fx.GraphModule, device: torch.device, signature: ChunkSignature,
                  degree: int, s: int) -> list[StageProgram]:
    """Stage ``s``'s ``degree`` tensor-parallel workers (:func:`mesh_stage` of ``Mesh(tp=
    degree)``)."""
    return mesh_stage(module, device, signature, Mesh(tp=degree), s)


def mesh_stage(module: fx.GraphModule, device: torch.device, signature: ChunkSignature,
               mesh: Mesh, s: int, cut: WorkerCut | None = None,
               ring_gather: str = "") -> list[StageProgram]:
    """Stage ``s``'s workers on ``mesh``: each its worker graph (tensor parallelism alone:
    its shard, :func:`shard_graph`; else ``cut``, default :func:`worker_graph`) cut into
    parts at its collectives (:func:`split_parts`); each K/V buffer named per worker. A
    tensor-parallel stage in which nothing can be cut runs whole on every worker (exact,
    and priced so).

    Raises:
        SpecError: the stage's cut axes do not divide into the mesh's degrees.
    """
    info = module.meta[STAGE_INFO]
    what = f"stage {s} ({info.layers[0]}..)"
    label = "tp" if mesh.size == mesh.tp else "".join(
        f"{a}{getattr(mesh, a)}." for a in AXES if getattr(mesh, a) > 1) + "w"
    if mesh.size == mesh.tp and not cuttable(module):  # e.g. an embedding alone
        whole = _stage(module, device, signature)
        return [_rank_buffers(dataclasses.replace(whole, rank=r), r, label)
                for r in range(mesh.size)]
    workers = []
    for r in range(mesh.size):
        if mesh.size == mesh.tp:
            graph = shard_graph(module, r, mesh.tp, what)
        else:
            graph = cut(module, mesh, r, what) if cut is not None else worker_graph(
                module, mesh, r, output_rows=signature.output_rows, what=what,
                ring_gather=ring_gather)
        workers.append(_worker(graph, info, module, device, signature, r, label, mesh.tp))
    return workers


def _worker(shard: fx.GraphModule, info: StageInfo, module: fx.GraphModule,
            device: torch.device, signature: ChunkSignature, r: int, label: str,
            degree: int = 1) -> StageProgram:
    """Worker ``r``'s stage program: its graph cut into parts at its collectives (on the
    last stage of a tensor-parallel group, its vocabulary slice written in place:
    :func:`_gather_in_place`)."""
    pieces, joins = split_parts(shard)
    parts = []
    for q, part in enumerate(pieces):
        ins = tuple(p.name for p in part.graph.find_nodes(op="placeholder")
                    if p.meta[CHUNK_INPUT].kind == "boundary")
        outs = info.outputs if q == len(pieces) - 1 else ("carried",)
        part.meta[STAGE_INFO] = StageInfo(info.index, info.layers, ins, outs, info.buffers)
        part.tppc_positional = module.tppc_positional
        parts.append(_rank_buffers(dataclasses.replace(_stage(part, device, signature), rank=r),
                                   r, label))  # a part knows its worker (hoisted consts)
    if label == "tp" and not info.outputs and joins and joins[-1].kind == "all_gather":
        parts[-2] = _gather_in_place(parts[-2], parts[-1], signature, joins[-1].dims[0], r,
                                     degree)
    shard.meta[STAGE_INFO] = info
    tensors = [*shard.parameters(), *shard.buffers()]
    return dataclasses.replace(
        parts[0], module=shard, runnable=shard, boundary_out=parts[-1].boundary_out,
        buffers=tuple({b.name: b for p in parts for b in p.buffers}.values()),
        out_slots=(*parts[-2].out_slots, *parts[-1].out_slots) if len(parts) > 1
        else parts[-1].out_slots, rank=r, parts=tuple(parts),
        joins=tuple((j.kind, j.dims) for j in joins),
        join_axes=tuple(j.group for j in joins) if label != "tp" else (),
        param_count=sum(p.numel() for p in shard.parameters()),
        param_bytes=sum(t.numel() * t.element_size() for t in tensors))


def _gather_in_place(part: StageProgram, last: StageProgram, signature: ChunkSignature,
                     axis: int, r: int, degree: int) -> StageProgram:
    """``part`` (before the all-gather that ends the last stage) writing worker ``r``'s slice
    of the gathered output straight into the call's output, when it can
    (:func:`tppc.passes.stages.direct_output.write_piece_in_place`); else ``part``."""
    done = write_piece_in_place(part.module, last.module, signature.output_axes, axis, r, degree)
    if done is None:
        return part
    runnable, slot = done
    return dataclasses.replace(part, runnable=runnable, out_slots=(slot,))


def _rank_buffers(stage: StageProgram, rank: int, label: str = "tp") -> StageProgram:
    """The stage's K/V buffers named for worker ``rank`` (a call state holds one per name):
    ``<name>@tp<r>`` on a tensor-parallel stage, ``<name>@cfg2.ulysses2.w<r>`` on a mesh (the
    degrees in the name: another mesh's worker holds buffers of another shape; ``/own``
    after a ring worker's own block, :mod:`tppc.passes.meshcut.ring_form`)."""
    own = {b.name for b in stage.buffers if b.parts > 1}

    def named(name: str) -> str:  # a ring worker's own block: another shape
        return f"{name}@{label}{rank}" + ("/own" if name in own else "")
    return dataclasses.replace(
        stage, inputs=tuple((named(n) if spec.kind in ("key", "value", "state") else n, spec)
                            for n, spec in stage.inputs),
        buffers=tuple(dataclasses.replace(b, name=named(b.name)) for b in stage.buffers))


def _stage(module: fx.GraphModule, device: torch.device, signature: ChunkSignature
           ) -> StageProgram:
    module = _own_tensors(module, device)
    info = module.meta[STAGE_INFO]
    inputs = tuple((p.name, p.meta[CHUNK_INPUT]) for p in module.graph.find_nodes(op="placeholder"))
    buffers = tuple(
        BufferSpec(name=name, kind=spec.kind, attention=spec.source, layer=spec.layer,
                   axis=None if spec.axis is None else int(spec.axis), shape=spec.shape,
                   dtype=spec.dtype, scale=spec.scale, prefix=spec.prefix, suffix=spec.suffix,
                   parts=spec.parts)
        for name, spec in inputs if spec.kind in ("key", "value", "state"))
    runnable, slots = module, {}
    if not info.outputs:  # the last stage: its outputs are the model's
        axes = tuple(axis if not rows or tuple(rows) in ((1, 0), (1, 0, 1)) else None
                     for axis, rows in itertools.zip_longest(signature.output_axes,
                                                              signature.output_rows))
        runnable, slots = write_outputs_in_place(module, axes)  # one row per unit only
    tensors = [*module.parameters(), *module.buffers()]
    return StageProgram(
        index=info.index, device=device, layers=info.layers, module=module, runnable=runnable,
        positional=module.tppc_positional, inputs=inputs, boundary_in=info.inputs,
        boundary_out=info.outputs, buffers=buffers, out_slots=tuple(slots.values()),
        param_count=sum(p.numel() for p in module.parameters()),
        param_bytes=sum(t.numel() * t.element_size() for t in tensors))


def _own_tensors(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Give ``module`` (and its submodules) new tensor objects on ``device``, and make the
    tensors its nodes create there (:func:`place_constructors`)."""
    place_constructors(module, device)
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(_on(param, device), requires_grad=False)
        for name, buf in list(sub.named_buffers(recurse=False)):
            sub._buffers[name] = _on(buf, device)
    return module


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = tensor.detach()
    return data if data.device == device else data.to(device, copy=True)


def device_for(stage: StagePlan, s: int, devices: Sequence[str | torch.device] | None
               ) -> torch.device:
    """The torch device of stage ``s``: ``devices[s]``, ``cpu`` for CPU presets, else CUDA."""
    if devices is not None:
        if len(devices) < s + 1:
            raise SpecError(f"devices={list(devices)} names {len(devices)} devices, the plan "
                            f"has more stages. fix: give one device per stage")
        return torch.device(devices[s])
    if stage.device_name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > stage.device_index:
        return torch.device("cuda", stage.device_index)
    raise SpecError(
        f"stage {s} is planned for a {stage.device_name}, but cuda:{stage.device_index} is not "
        f"available here. fix: pass devices=['cpu', ...] to run the stages on this machine")
