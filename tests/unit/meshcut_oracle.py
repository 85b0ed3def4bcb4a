"""The oracle of the mesh-cut tests: a model compiled into stage graphs, each stage's feed
of one chunk recorded from a real call, every stage's workers run in lockstep
(:func:`tppc.passes.meshcut.lockstep.run_workers`), the leader's outputs returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import tppc
from tppc.driver.emit import build_program
from tppc.ir.records import CHUNK_INPUT, STAGE_INFO
from tppc.passes.meshcut.lockstep import run_workers
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.program.mesh import Mesh

__all__ = ["Staged", "run_mesh", "staged"]


@dataclasses.dataclass
class Staged:
    """A compiled model's stage graphs and what each was fed on the example call."""

    graphs: list[Any]
    feeds: list[dict[str, Any]]
    rows: list[dict[str, int]]
    output_rows: tuple
    want: Any
    tail: Any = None
    flat: tuple = ()


def staged(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
           num_stages: int = 1) -> Staged:
    """Compile ``model`` into ``num_stages`` stages of one chunk and record each feed."""
    kwargs = kwargs or {}
    cp = tppc.compile(model, args, kwargs, cluster=f"{num_stages}xcpu", num_stages=num_stages,
                      verify=False)
    front = cp._front
    program = build_program(front.chunk, front.ctx, cp.plan, degrees=(1,) * num_stages)
    feeds: list[dict[str, Any]] = [{} for _ in program.stages]
    rows: list[dict[str, int]] = [{} for _ in program.stages]

    def recorder(s: int, stage: Any) -> Any:
        def run(*values: Any) -> Any:
            for (name, spec), value in zip(stage.inputs, values, strict=False):
                if spec.kind in ("key", "value"):
                    rows[s][name] = value.shape[spec.axis]
                elif spec.kind != "boundary":
                    feeds[s][name] = value
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
    return Staged([st.module for st in program.stages], feeds, rows,
                  program.signature.output_rows, want, program.tail, flat[0] if flat else ())


def run_mesh(st: Staged, mesh: Mesh) -> tuple[Any, ...]:
    """The leader's outputs of every stage's workers on ``mesh``, in lockstep."""
    boundary: list[tuple[Any, ...]] = [() for _ in range(mesh.size)]
    outs: list[tuple[Any, ...]] = []
    for s, stage in enumerate(st.graphs):
        graphs = [worker_graph(stage, mesh, r, output_rows=st.output_rows)
                  for r in range(mesh.size)]
        for g in graphs:
            assert all(ph.meta.get(CHUNK_INPUT) is not None
                       for ph in g.graph.find_nodes(op="placeholder")), g
        outs = run_workers(graphs, mesh, st.feeds[s], boundary,
                           [{} for _ in range(mesh.size)], st.rows[s])
        if stage.meta[STAGE_INFO].outputs:
            boundary = outs
    if st.tail is not None:
        with torch.no_grad():
            return tuple(st.tail(*st.flat, *outs[0]))
    return outs[0]
