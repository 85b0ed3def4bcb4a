"""The oracle of the mesh-cut tests: a model compiled into stage graphs, each stage's feed
of every chunk recorded from a real call, every stage's workers run in lockstep
(:func:`tppc.passes.meshcut.lockstep.run_workers`) chunk after chunk, the leader's outputs
joined along their token axes (then the epilogue), for comparison with the eager model.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

import tppc
from tppc.backends.torch_local import chunk_rows
from tppc.driver.emit import build_program
from tppc.ir.records import CHUNK_INPUT, STAGE_INFO
from tppc.passes.meshcut.lockstep import run_workers
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.program.mesh import Mesh

__all__ = ["Staged", "patch_feeds", "run_mesh", "staged"]


@dataclasses.dataclass
class Staged:
    """A compiled model's stage graphs and what each was fed on the example call.

    Attributes:
        graphs: the stage graphs.
        feeds: per stage, per chunk: the call-fed values by placeholder name.
        rows: per stage: each K/V buffer's length on its token axis.
        signature: the chunk signature (output axes, output rows).
        want: the eager model's outputs.
        tail: the program's epilogue, and ``flat`` the inputs it read.
    """

    graphs: list[Any]
    feeds: list[list[dict[str, Any]]]
    rows: list[dict[str, int]]
    signature: Any
    want: Any
    tail: Any = None
    flat: tuple = ()


def staged(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
           num_stages: int = 1, chunks: int | None = None) -> Staged:
    """Compile ``model`` into ``num_stages`` stages and record each stage's feeds."""
    kwargs = kwargs or {}
    extra = {"chunks": chunks} if chunks else {}
    cp = tppc.compile(model, args, kwargs, cluster=f"{num_stages}xcpu", num_stages=num_stages,
                      verify=False, **extra)
    front = cp._front
    program = cp.programs.get(front, front.ctx.example_seq) if hasattr(cp.programs, "get") \
        else None
    program = program or build_program(front.chunk, front.ctx, cp.plan,
                                       degrees=(1,) * num_stages)
    feeds: list[list[dict[str, Any]]] = [[] for _ in program.stages]
    rows: list[dict[str, int]] = [{} for _ in program.stages]

    def recorder(s: int, stage: Any) -> Any:
        def run(*values: Any) -> Any:
            feeds[s].append({})
            for (name, spec), value in zip(stage.inputs, values, strict=False):
                if spec.kind in ("key", "value"):
                    rows[s][name] = value.shape[spec.axis]
                elif spec.kind != "boundary":
                    feeds[s][-1][name] = value
            return stage.runnable(*values)
        return run

    stages = tuple(dataclasses.replace(st, runnable=recorder(s, st))
                   for s, st in enumerate(program.stages))
    flat: list[tuple] = []
    leaves = len(program.signature.output_axes)

    def tail(*values: Any) -> Any:  # the epilogue after the last stage: record its inputs
        flat.append(values[:len(values) - leaves])
        return program.tail(*values)

    cp.programs.hold(front, dataclasses.replace(
        program, stages=stages, tail=tail if program.tail is not None else None))
    with torch.no_grad():
        cp(*args, **kwargs)
        want = model(*args, **kwargs)
    return Staged([st.module for st in program.stages], feeds, rows, program.signature,
                  want, program.tail, flat[0] if flat else ())


def patch_feeds(st: Staged, bounds: list[int]) -> list[list[dict[str, Any]]]:
    """Each stage's feeds of the patches ``[bounds[i], bounds[i+1])`` (PipeFusion's chunks
    of one step), cut from the recorded feed of the whole sequence."""
    out = []
    for s, stage in enumerate(st.graphs):
        whole, length = st.feeds[s][0], bounds[-1]
        specs = {p.name: p.meta[CHUNK_INPUT] for p in stage.graph.find_nodes(op="placeholder")}
        rows = []
        for a, b in itertools.pairwise(bounds):
            feed = dict(whole)
            for name, value in whole.items():
                spec = specs[name]
                if spec.kind in ("token", "positional") and spec.axis is not None:
                    feed[name] = chunk_rows(value, spec, a, b, length)
                elif spec.kind in ("chunk_start", "chunk_size"):
                    feed[name] = a if spec.kind == "chunk_start" else b - a
            rows.append(feed)
        out.append(rows)
    return out


def run_mesh(st: Staged, mesh: Mesh, *steps: list[list[dict[str, Any]]]) -> tuple[Any, ...]:
    """The leader's outputs of every stage's workers on ``mesh``, in lockstep, chunk after
    chunk (K/V buffers kept across chunks and ``steps``: each step's feeds, per stage and
    chunk; default: the recorded call), joined along the outputs' token axes (the last
    step's)."""
    rows = st.signature.output_rows
    workers = [[worker_graph(stage, mesh, r, output_rows=rows) for r in range(mesh.size)]
               for stage in st.graphs]
    for graphs in workers:
        for g in graphs:
            assert all(ph.meta.get(CHUNK_INPUT) is not None
                       for ph in g.graph.find_nodes(op="placeholder"))
    buffers = [[{} for _ in range(mesh.size)] for _ in st.graphs]
    for feeds in steps or (st.feeds,):
        chunks = []
        for i in range(len(feeds[0])):
            boundary: list[tuple[Any, ...]] = [() for _ in range(mesh.size)]
            for s, stage in enumerate(st.graphs):
                outs = run_workers(workers[s], mesh, feeds[s][i], boundary, buffers[s],
                                   st.rows[s])
                if stage.meta[STAGE_INFO].outputs:
                    boundary = outs
            chunks.append(outs[0])
    joined = tuple(values[-1] if axis is None else torch.cat(values, axis)
                   for axis, values in zip(st.signature.output_axes, zip(*chunks),
                                           strict=True))
    if st.tail is not None:
        with torch.no_grad():
            return tuple(st.tail(*st.flat, *joined))
    return joined
