"""``denoise(patches=None)`` runs the diffusion plan's patches (issue 13), against the eager
serial loop ``model → scheduler.step`` and the plan's own boundaries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc import examples
from tppc.pipefusion import denoise as denoise_module
from tppc.planner.manual import manual_plan
from tppc.planner.workload import Workload

diffusers = pytest.importorskip("diffusers")


def _serial(model, x, steps, y):
    return serial_denoise(model, x, diffusers.DDIMScheduler(), steps, timestep_arg="t",
                          model_kwargs={"y": y})


@pytest.fixture
def bounds_used(monkeypatch):
    """The patch boundaries every ``denoise`` call built its programs for."""
    seen: list[tuple[int, ...]] = []
    original = denoise_module.patch_programs

    def spy(cp, front, plan, length, bounds):
        seen.append(bounds)
        return original(cp, front, plan, length, bounds)

    monkeypatch.setattr(denoise_module, "patch_programs", spy)
    return seen


def test_patches_none_takes_the_diffusion_plans_split(bounds_used) -> None:
    model, args, kwargs = examples.dit(size=32)  # 16 patch rows: the planner cuts them
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, executor="threads")
    plan = cp.denoise_plan(8, 1)
    assert plan.workload == Workload(kind="diffusion", steps=8, warmup_steps=1)
    assert len(plan.boundaries) > 2, "expected the planner to cut 16 rows into patches"
    cp.denoise(args[0], diffusers.DDIMScheduler(), 8, warmup_steps=1,
               model_kwargs={"y": args[2]}, timestep_arg="t")
    assert bounds_used[-1] == plan.boundaries
    assert cp.denoise_plan(8, 1) is plan  # cached per (steps, warm-up)


def test_patches_none_with_warmup_on_every_step_equals_the_serial_loop() -> None:
    model, args, kwargs = examples.dit(size=32)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, executor="threads")
    out = cp.denoise(args[0], diffusers.DDIMScheduler(), 3, warmup_steps=3,
                     model_kwargs={"y": args[2]}, timestep_arg="t")
    assert_kernels_close(out, _serial(model, args[0], 3, args[2]), depth=3)


def test_a_given_diffusion_plan_gives_its_boundaries(bounds_used) -> None:
    model, args, kwargs = examples.dit()
    n = len(tppc.compile(model, args, kwargs, executor="local").context.layers)
    plan = dataclasses.replace(manual_plan(n, 8, cuts=(0, 3, n), boundaries=(0, 3, 8)),
                               workload=Workload(kind="diffusion", steps=3, warmup_steps=1))
    cp = tppc.compile(model, args, kwargs, plan=plan, executor="threads")
    assert_kernels_close(cp(*args, **kwargs), model(*args))
    x = torch.randn_like(args[0])
    pipelined = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=1,
                           model_kwargs={"y": args[2]}, timestep_arg="t")
    assert bounds_used[-1] == (0, 3, 8)
    ref = _serial(model, x, 3, args[2])
    assert 0 < float(((pipelined - ref) ** 2).mean()) < 0.1 * float((ref ** 2).mean())
    exact = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=3,
                       model_kwargs={"y": args[2]}, timestep_arg="t")
    assert_kernels_close(exact, ref, depth=3)


def test_a_plain_compile_of_a_dit_is_priced_in_tokens_not_patch_rows() -> None:
    """Own DiT, 16x16 latent, patch 2: 8 patch rows of 8 tokens. One stage, one chunk: the
    predicted latency is the layers' time at c = 64 tokens (the cost table's own layer
    functions, summed by hand), not at c = 8 rows. Priced on the (pinned) CPU: on a GPU
    preset every op of this tiny model costs the same host issue time at 8 and 64 tokens."""
    from tppc.cost_models import build_cost_table

    model, args, kwargs = examples.dit()
    cp = tppc.compile(model, args, kwargs, executor="local", cluster="1xcpu",
                       devices=["cpu"])
    front = cp.bind(args, kwargs)[0]
    ctx = front.ctx
    tokens = int(ctx.token_count.subs(ctx.seq_symbol, ctx.example_seq))
    assert (cp.plan.seq_len, tokens) == (8, 64) and cp.plan.boundaries == (0, 8)
    table = build_cost_table(front.chunk, ctx.layers, "1xcpu", tokens,
                             seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    by_hand = sum(float(lc.time(float(tokens), 0.0)) for lc in table.layers[0])
    at_rows = sum(float(lc.time(8.0, 0.0)) for lc in table.layers[0])
    assert cp.plan.latency == pytest.approx(by_hand, rel=1e-6)
    assert at_rows != pytest.approx(by_hand, rel=1e-6)  # the two pricings differ


def test_tppc_plan_of_a_dit_counts_whole_patch_rows() -> None:
    """Own DiT, 32x32 latent, patch 2: 16 patch rows of 16 tokens; ``tppc.plan`` prices
    tokens and returns its plan in patch rows (the unit of the latent's sequence axis, as
    ``tppc.compile`` does), saying so: its chunks (patches) are whole patch rows."""
    from tppc.driver.planning import plan

    model, args, kwargs = examples.dit(size=32)
    result = plan(model, args, kwargs, cluster="4xh100-sxm", time_limit=5.0,
                  workload=Workload(kind="diffusion", steps=20, warmup_steps=1))
    assert (result.seq_len, result.granularity, result.tokens_per_unit) == (16, 1, 16)
    assert (result.unit, result.seq_tokens) == ("patch rows of 16 tokens", 256)
    assert result.boundaries[0] == 0 and result.boundaries[-1] == 16
