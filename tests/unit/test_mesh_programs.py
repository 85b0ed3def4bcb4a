"""Programs whose stages run on a mesh of workers (cfg, ring, ulysses, tp): the groups of
each axis, the wiring by coordinates, and the runs of every in-process executor and the
validation replay against the eager model.

The worker graphs here come from ``tests/unit/mesh_cuts.py`` (every worker computes its
stage; the last stage gathers its batch parts over its cfg group), so these tests check
what the runtime owns, apart from the graph side's cuts.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tests.unit.mesh_cuts import replicated_cut
from tppc.distributed.pipeline import check_world
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


def _mesh_plan(plan: tppc.Plan, **degrees: int) -> tppc.Plan:
    """``plan`` with every stage on a mesh of ``degrees`` (``cfg_parallel=2``, ...)."""
    degrees = {"cfg_parallel": 1, "ulysses": 1, "ring": 1, "tensor_parallel": 1, **degrees}
    n = math.prod(degrees.values())
    stages = tuple(dataclasses.replace(
        st, **degrees, device_index=n * s, device_indices=tuple(range(n * s, n * s + n)))
        for s, st in enumerate(plan.stages))
    return dataclasses.replace(plan, stages=stages)


@pytest.fixture(scope="module")
def guided() -> tuple:
    model, args = _guided_dit()
    cp = tppc.compile(model, args, cluster="8xcpu", num_stages=2, executor="threads",
                      verify=False, cfg_parallel=1, ulysses=1, ring=1, tensor_parallel=1)
    with torch.no_grad():
        want = model(*args)
    return cp, args, want


def test_a_cfg_parallel_program_equals_eager_on_every_executor_and_the_replay(guided) -> None:
    cp, args, want = guided
    front = cp._front
    program = build_program(front.chunk, front.ctx, _mesh_plan(cp.plan, cfg_parallel=2),
                            cut=replicated_cut)  # the runtime alone: see mesh_cuts.py
    assert [(w.index, w.rank) for w in program.workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({b.name for w in program.workers for b in w.buffers}) == \
        sum(len(w.buffers) for w in program.workers)  # every worker its own K/V
    cp.programs.hold(front, program)
    for executor in ("local", "threads"):
        assert_kernels_close(cp.run(args, executor=executor), want)
    bound = cp.bind(args, {})[1]
    run = check_replay(front, "compiled program", program, None, bound.flat, bound.length,
                       program.chunks, warmup=False)  # raises past its tolerance
    assert run.max_diff < 1e-4


@pytest.mark.parametrize("degrees", [{"cfg_parallel": 2}, {"ulysses": 2}, {"ring": 2},
                                     {"cfg_parallel": 2, "ulysses": 2},
                                     {"ring": 2, "tensor_parallel": 2}],
                         ids=["cfg2", "ulysses2", "ring2", "cfg2xulysses2", "ring2xtp2"])
def test_the_mesh_cut_runs_exactly_in_threads(guided, degrees: dict[str, int]) -> None:
    cp, args, want = guided
    front = cp._front
    program = build_program(front.chunk, front.ctx, _mesh_plan(cp.plan, **degrees))
    n = len(program.workers) // 2
    assert {g for g, _ in program.groups} >= {f"{a}0.0" for a, d in (
        ("cfg", degrees.get("cfg_parallel", 1)), ("ulysses", degrees.get("ulysses", 1)),
        ("ring", degrees.get("ring", 1))) if d > 1} and n == math.prod(degrees.values())
    cp.programs.hold(front, program)
    for executor in ("local", "threads") if "ring" in degrees else ("threads",):
        assert_kernels_close(cp.run(args, executor=executor), want)


def test_a_degree_the_batch_does_not_take_is_refused_by_name(guided) -> None:
    cp, _, _ = guided
    with pytest.raises(SpecError, match=r"stage 0"):
        build_program(cp._front.chunk, cp._front.ctx, _mesh_plan(cp.plan, cfg_parallel=4))


def test_denoise_on_a_mesh_equals_the_serial_loop_warm_and_one_worker_per_stage_stale(
        guided) -> None:
    """Stale patches on a mesh: each worker keeps the stale K/V of its part (a CFG group its
    half of the batch, a Ulysses worker its heads, a Ring worker its own block of every
    patch, passed around whole), so the loop equals the same loop on one worker per stage;
    every step warm, it equals the eager loop."""
    diffusers = pytest.importorskip("diffusers")
    cp, (x, _, y), _ = guided
    front = cp._front

    def denoise(warmup: int | None, **degrees: int) -> torch.Tensor:
        cp.programs.hold(front, build_program(front.chunk, front.ctx,
                                              _mesh_plan(cp.plan, **degrees)))
        return cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=warmup, patches=2,
                          timestep_arg="t", model_kwargs={"y": y})

    want = serial_denoise(cp.model, x, diffusers.DDIMScheduler(), 3, timestep_arg="t",
                          model_kwargs={"y": y})
    assert_kernels_close(denoise(None, cfg_parallel=2), want, depth=3)
    stale = denoise(1)
    assert not torch.equal(stale, want)
    for degrees in ({"cfg_parallel": 2}, {"ulysses": 2}, {"ring": 2}):
        assert_kernels_close(denoise(1, **degrees), stale, depth=3)


def test_a_job_of_another_size_is_refused_naming_the_meshes(guided) -> None:
    cp, _, _ = guided
    front = cp._front
    program = build_program(front.chunk, front.ctx, _mesh_plan(cp.plan, cfg_parallel=2,
                                                               ulysses=2),
                            devices=("meta",) * 2)
    check_world(program, 8)
    with pytest.raises(SpecError, match=r"needs 8 ranks \(2 stages at groups 4 \(cfg2 x "
                       r"ulysses2\), 4 \(cfg2 x ulysses2\).*the job has 4.*--nproc-per-node 8"):
        check_world(program, 4)


def test_only_one_stage_of_several_workers_over_several_steps_waits_for_the_step_aside(
        ) -> None:
    """No list of one stage goes back to stage 0 (its workers are the last stage's), so its
    workers wait for each stepped patch outside the lists (``one_stage``); with two stages
    the feedback receive waits, and one step needs no wait."""
    from tppc.pipefusion.jobs import one_stage
    from tppc.program.dry_run import check_actions

    def dry(stage_of: tuple[int, ...], steps: int) -> object:
        rows = sharded_lists(((0, 2), (2, 4)), steps, stage_of, (1,) * len(stage_of),
                             ((),) * len(stage_of), [Mesh(cfg=stage_of.count(0))] * (
                                 max(stage_of) + 1))
        return check_actions(rows, groups=mesh_groups(stage_of, [Mesh(
            cfg=stage_of.count(0))] * (max(stage_of) + 1)), stages=stage_of)

    assert one_stage(dry((0, 0), 2))
    assert not one_stage(dry((0, 0), 1))
    assert not one_stage(dry((0, 0, 1, 1), 2))
