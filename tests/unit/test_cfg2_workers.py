"""A CFG-2 plan on ``2xcpu`` as the drop-in runs it.

A worker's intra-op threads follow its plan device (its CPU device's share of the machine's
cores), never the calling thread's torch count: the counts the workers really run with, on
every in-process path the drop-in takes (a call, ``cp.denoise``'s warm and stale steps, the
drop-in's ``StepCalls``). A diffusion plan for a new step count (the drop-in's first call of
a loop) re-solves without pricing the meshes again."""

from __future__ import annotations

import threading

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.backends import torch_threads
from tppc.driver import mesh_planning
from tppc.examples.hf import dit
from tppc.pipefusion import jobs as denoise_jobs
from tppc.pipefusion.step import StepCalls
from tppc.program.cores import machine_cores

CORES = machine_cores()  # physical cores (test_rank_threads checks how they are counted)
EACH = max(1, CORES // 2)
"""Hand-computed: 2 CPU devices share the machine's cores."""


@pytest.fixture(scope="module")
def cfg2() -> tuple:
    model, _, _ = dit(size=8, depth=2)
    torch.manual_seed(1)
    args = (torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0]))
    cp = tppc.compile(model, args, cluster="2xcpu", executor="threads", verify=False,
                      cfg_parallel=2, num_stages=1, ulysses=1, ring=1, tensor_parallel=1)
    assert [st.device_indices for st in cp.plan.stages] == [(0, 1)]
    return cp, args


@pytest.fixture
def counts(monkeypatch) -> dict[str, set[int]]:
    """The intra-op threads of every compute, by thread name, with the caller on a count
    no share of the cores gives (2 × cores + 2)."""
    seen: dict[str, set[int]] = {}
    for module in (torch_threads, denoise_jobs):
        real = module.run_stage

        def spy(*args, real=real):
            seen.setdefault(threading.current_thread().name, set()).add(
                torch.get_num_threads())
            return real(*args)

        monkeypatch.setattr(module, "run_stage", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2 * CORES + 2)
    yield seen
    torch.set_num_threads(before)


def test_each_cfg_worker_runs_its_devices_share_of_the_cores_not_the_callers(cfg2, counts
                                                                             ) -> None:
    cp, args = cfg2
    assert [w.threads for w in cp.program(cp.plan.seq_len).runners] == [EACH, EACH]
    with torch.no_grad():
        want = cp.model(*args)
    assert_kernels_close(cp(*args), want)
    assert sorted(counts.values(), key=sorted) == [{EACH}, {EACH}]


def test_stale_patches_on_a_mesh_borrow_no_threads_from_the_workers_beside_them(cfg2, counts
                                                                                ) -> None:
    """A CFG group's workers compute each patch together: neither takes the other's threads
    for the fill or the drain (a pipeline of one worker a stage does)."""
    diffusers = pytest.importorskip("diffusers")
    cp, (x, t, y) = cfg2
    cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=2, timestep_arg="t",
               model_kwargs={"y": y})
    calls = StepCalls(cp, warmup_steps=1, patches=2)  # the drop-in, one call per step
    calls((x, t, y), {})
    calls((x, t * 0 + 500, y), {})
    assert {n for name, ns in counts.items() for n in ns} == {EACH}
    assert len(counts) >= 4  # the warm and the stale workers of both paths


def test_a_diffusion_plan_for_a_new_step_count_prices_no_mesh_again(cfg2, monkeypatch) -> None:
    cp, _ = cfg2
    priced: list[object] = []
    real = mesh_planning.group_cost_table

    def spy(*args, **kwargs):
        priced.append(kwargs.get("mesh"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mesh_planning, "group_cost_table", spy)
    plans = [cp.denoise_plan(steps, 1) for steps in (7, 9)]
    assert priced == []  # the compile priced CFG-2 already
    assert [p.workload.steps for p in plans] == [7, 9]
    assert [p.degrees["cfg_parallel"] for p in plans] == [2, 2]
