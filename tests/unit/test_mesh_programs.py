"""Programs whose stages run on a mesh of workers (cfg, ring, ulysses, tp): the groups of
each axis, the wiring by coordinates, and the runs of every in-process executor and the
validation replay against the eager model.

The worker graphs here come from ``tests/unit/mesh_cuts.py`` (every worker computes its
stage; the last stage gathers its batch parts over its cfg group), so these tests check
what the runtime owns, apart from the graph side's cuts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tests.unit.mesh_cuts import replicated_cut
from tppc.driver.emit import build_program
from tppc.errors import PlanError, SpecError
from tppc.examples.hf import dit
from tppc.program.mesh import Mesh
from tppc.program.sharded import mesh_groups, sharded_groups, sharded_lists
from tppc.validation.validate import check_replay


def test_a_tensor_parallel_stage_keeps_its_one_group_per_stage() -> None:
    assert mesh_groups((0, 0, 1, 1, 1)) == sharded_groups((0, 0, 1, 1, 1)) == (
        ("tp0", (0, 1)), ("tp1", (2, 3, 4)))


def test_groups_of_every_axis_hold_the_workers_that_differ_only_there() -> None:
    meshes = (Mesh(cfg=2, tp=2), Mesh(cfg=2, ulysses=2))
    stage_of = (0, 0, 0, 0, 1, 1, 1, 1)
    assert dict(mesh_groups(stage_of, meshes)) == {
        "cfg0.0": (0, 2), "cfg0.1": (1, 3), "tp0.0": (0, 1), "tp0.1": (2, 3),
        "cfg1.0": (4, 6), "cfg1.1": (5, 7), "ulysses1.0": (4, 5), "ulysses1.1": (6, 7)}


def _peers(rows: tuple) -> list[tuple[list[int], list[int]]]:
    """Each worker's (sources, destinations)."""
    return [(sorted({a.peer for a in row if a.kind == "recv"}),
             sorted({a.peer for a in row if a.kind == "send"})) for row in rows]


def test_a_worker_receives_from_its_cfg_coordinates_and_tp_rank_mod_the_degree() -> None:
    # stage 0: cfg2 x tp2 (workers 0-3), stage 1: cfg2 (workers 4, 5)
    meshes = (Mesh(cfg=2, tp=2), Mesh(cfg=2))
    rows = sharded_lists(((0, 4),), 1, (0, 0, 0, 0, 1, 1), (1,) * 6, ((),) * 6, meshes)
    assert _peers(rows) == [([], [4]), ([], []), ([], [5]), ([], []), ([0], []), ([2], [])]
    back = sharded_lists(((0, 4),), 1, (0, 0, 1, 1, 1, 1), (1,) * 6, ((),) * 6,
                         (Mesh(cfg=2), Mesh(cfg=2, tp=2)))
    assert _peers(back) == [([], [2, 3]), ([], [4, 5]), ([0], []), ([0], []), ([1], []),
                            ([1], [])]


def test_a_join_runs_over_the_group_of_its_axis() -> None:
    meshes = (Mesh(cfg=2, tp=2),)
    joins = (("all_reduce", (), "tp"), ("all_gather", (0,), "cfg"))
    rows = sharded_lists(((0, 4),), 1, (0,) * 4, (3,) * 4, (joins,) * 4, meshes)
    assert [[a.group for a in row if a.collective] for row in rows] == [
        ["tp0.0", "cfg0.0"], ["tp0.0", "cfg0.1"], ["tp0.1", "cfg0.0"], ["tp0.1", "cfg0.1"]]


def test_stages_that_cut_the_batch_differently_are_refused() -> None:
    with pytest.raises(PlanError, match="cut the batch and tokens differently"):
        sharded_lists(((0, 4),), 1, (0, 0, 1), (1,) * 3, ((),) * 3, (Mesh(cfg=2), Mesh()))


def _guided_dit() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    model, _, _ = dit(size=8, depth=2)
    torch.manual_seed(1)  # a guided batch: the conditional and the unconditional half
    return model, (torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0]))


def _cfg_plan(plan: tppc.Plan, cfg: int = 2) -> tppc.Plan:
    stages = tuple(dataclasses.replace(
        st, cfg_parallel=cfg, device_index=cfg * s,
        device_indices=tuple(range(cfg * s, cfg * s + cfg))) for s, st in enumerate(plan.stages))
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_a_cfg_parallel_program_equals_eager(executor: str) -> None:
    model, args = _guided_dit()
    cp = tppc.compile(model, args, cluster="4xcpu", num_stages=2, executor=executor,
                      verify=False)
    front = cp._front
    program = build_program(front.chunk, front.ctx, _cfg_plan(cp.plan), cut=replicated_cut)
    assert [(w.index, w.rank) for w in program.workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({b.name for w in program.workers for b in w.buffers}) == \
        sum(len(w.buffers) for w in program.workers)  # every worker its own K/V
    cp.programs.hold(front, program)
    with torch.no_grad():
        want = model(*args)
    assert_kernels_close(cp(*args), want)
    if executor == "local":  # translation validation replays the same program
        bound = cp.bind(args, {})[1]
        run = check_replay(front, "compiled program", program, None, bound.flat,
                           bound.length, program.chunks, warmup=False)
        assert run.max_diff < 1e-4  # check_replay also raises past its own tolerance


def test_a_mesh_without_a_cut_is_refused_by_name() -> None:
    model, args = _guided_dit()
    cp = tppc.compile(model, args, cluster="4xcpu", num_stages=2, verify=False)
    with pytest.raises(SpecError, match=r"stage 0 .*no pass cuts a stage graph"):
        build_program(cp._front.chunk, cp._front.ctx, _cfg_plan(cp.plan))
