"""``tppc.plan`` and ``tppc.compile`` share one front end and one planner: for the same model,
inputs and options they return the same plan, in the same unit (issue 17)."""

from __future__ import annotations

import copy

import pytest

import tppc
from tppc import examples
from tppc.driver.options import CompileOptions
from tppc.driver.planning import example_plan
from tppc.errors import SpecError
from tppc.frontend.front_end import capture_front_end
from tppc.planner import Plan, Workload

CLUSTER = "2xa100-80gb@pcie4"  # at 8192 tokens the planner cuts these small models in chunks
LONG = 8192
CPU = ["cpu", "cpu"]


def _assert_same(a: Plan, b: Plan) -> None:
    assert (a.seq_len, a.granularity, a.tokens_per_unit, a.workload) == \
        (b.seq_len, b.granularity, b.tokens_per_unit, b.workload)
    assert a.boundaries == b.boundaries
    assert a.stages == b.stages
    assert a.latency == pytest.approx(b.latency, rel=1e-9)


@pytest.mark.parametrize(("name", "options"), [
    ("gpt", {"seq_len": 64}), ("hf_llama", {"seq_len": 64, "layers": 4})])
def test_plan_and_compile_agree_on_a_causal_lm(name, options) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, args, kwargs = getattr(examples, name)(**options)
    cp = tppc.compile(model, args, kwargs, cluster=CLUSTER, num_stages=2, executor="local",
                      devices=CPU)
    _assert_same(tppc.plan(model, args, kwargs, cluster=CLUSTER, num_stages=2), cp.plan)
    long = tppc.plan(model, args, kwargs, cluster=CLUSTER, num_stages=2, seq_len=LONG)
    assert len(long.chunks) > 1 and long.num_stages == 2, "expected a split to compare"
    assert (long.unit, long.seq_tokens) == ("tokens", LONG)
    _assert_same(long, cp.program(LONG).plan)


def test_plan_and_compile_agree_on_a_dit_in_patch_rows() -> None:
    """Own DiT, 64x64 latent, patch 2: 32 patch rows of 32 tokens (counted by hand). On the
    pinned CPU: on an A100 preset this tiny model's ops all cost the host's issue time, and
    patches would only add ops (the planner rightly keeps one chunk there)."""
    model, args, kwargs = examples.dit(size=64)
    cp = tppc.compile(model, args, kwargs, cluster="4xcpu", executor="local",
                      devices=["cpu"] * 4)
    plain = tppc.plan(model, args, kwargs, cluster="4xcpu")
    _assert_same(plain, cp.plan)
    assert (plain.seq_len, plain.tokens_per_unit, plain.boundaries) == (32, 32, (0, 32))
    workload = Workload(kind="diffusion", steps=20, warmup_steps=1)
    patches = tppc.plan(model, args, kwargs, cluster="4xcpu", workload=workload)
    assert len(patches.chunks) > 1, "expected the planner to cut 32 rows into patches"
    assert patches.unit == "patch rows of 32 tokens" and patches.seq_tokens == 32 * 32
    _assert_same(patches, cp.denoise_plan(20, 1))


def test_a_meta_device_plan_equals_the_real_weights_plan() -> None:
    pytest.importorskip("transformers")
    model, args, kwargs = examples.hf_llama(seq_len=64, layers=4)
    meta = copy.deepcopy(model).to("meta")
    assert all(p.device.type == "meta" for p in meta.parameters())
    on_meta = tppc.plan(meta, args, kwargs, cluster=CLUSTER, num_stages=2, seq_len=LONG)
    real = tppc.plan(model, args, kwargs, cluster=CLUSTER, num_stages=2, seq_len=LONG)
    _assert_same(on_meta, real)
    cp = tppc.compile(model, args, kwargs, cluster=CLUSTER, num_stages=2, executor="local",
                      devices=CPU)
    _assert_same(on_meta, cp.program(LONG).plan)


def test_plan_takes_the_compile_options() -> None:
    """``chunks=4`` fixes the split as it does for ``tppc.compile``: 64 tokens in 4."""
    model, args, kwargs = examples.gpt(seq_len=64)
    assert tppc.plan(model, args, kwargs, chunks=4).boundaries == (0, 16, 32, 48, 64)
    with pytest.raises(SpecError, match="unknown compile option"):
        tppc.plan(model, args, kwargs, granularty=8)


def test_a_plan_in_another_unit_is_refused_by_compile() -> None:
    big, big_args, _ = examples.dit(size=32)  # 16 tokens per patch row
    plan = tppc.plan(big, big_args, cluster="2xcpu", num_stages=2)
    model, args, kwargs = examples.dit(size=16)  # 8 tokens per patch row
    with pytest.raises(SpecError, match="rows of 16 tokens"):
        tppc.compile(model, args, kwargs, plan=plan, executor="local")


def test_a_planning_front_end_holds_two_blocks_and_is_never_emitted() -> None:
    pytest.importorskip("transformers")
    model, args, kwargs = examples.hf_llama(seq_len=16, layers=4)
    front = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    assert front.truncated == ("model.layers", 4)
    blocks = [layer.name for layer in front.ctx.layers if layer.kind == "block"]
    assert blocks == [f"model.layers.{i}" for i in range(4)]
    assert len(model.model.layers) == 4  # restored
    with pytest.raises(SpecError, match="priced, not emitted"):
        example_plan(front, CompileOptions())


def test_cost_report_prices_the_layers_of_the_whole_model() -> None:
    """``tppc.cost_report`` captures as ``tppc.plan`` does (two blocks); its report equals
    the report of the whole model's chunk-step graph."""
    pytest.importorskip("transformers")
    from tppc.cost_models.report import report_from_graph
    from tppc.frontend.annotate import annotate_program

    model, args, kwargs = examples.hf_llama(seq_len=64, layers=4)
    report = tppc.cost_report(model, args, kwargs, cluster="1xh100-sxm", chunk=128,
                              prefix=256, seq_len=1024)
    gm, ctx = annotate_program(model, args, kwargs)
    whole = report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=128, prefix=256,
                              seq_len=1024)
    assert report.to_json() == whole.to_json()
