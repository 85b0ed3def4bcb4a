"""A whole diffusion pipeline planned (issue 20): the text encoder and the VAE decoder are
captured, priced with the transformer's device constants and placed on a device."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("tokenizers")

from test_diffusers_dropin import pixart_pipe

from tppc.cost_models.call_costs import price_call
from tppc.cost_models.cluster import Cluster
from tppc.diffusers import PipelinePlan, plan_pipeline
from tppc.errors import PlanInfeasible, SpecError
from tppc.frontend.static_export import export_static
from tppc.planner.workload import Workload

STEPS = Workload(kind="diffusion", steps=4, warmup_steps=1)


@pytest.fixture(scope="module")
def pixart():
    """The tiny PixArt pipeline and the transformer's inputs as the pipeline passes them."""
    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    with torch.inference_mode():
        pipe(num_inference_steps=2, output_type="latent", **call)
    hook.remove()
    args, kwargs = seen[0]
    whole = plan_pipeline(pipe, args, kwargs, cluster="2xcpu", workload=STEPS,
                          prompt_tokens=8, encoder_calls=2, num_stages=2)
    return pipe, seen[0], whole


def _plan(pipe, example, cluster, whole, **kw) -> PipelinePlan:
    """The pipeline planned again around ``whole``'s transformer plan."""
    args, kwargs = example
    return plan_pipeline(pipe, args, kwargs, cluster=cluster, prompt_tokens=8,
                         encoder_calls=2, transformer_plan=whole.transformer, **kw)


def test_the_call_is_the_encoders_the_loop_and_the_decoder(pixart) -> None:
    pipe, example, pp = pixart
    names = [(c.name, c.phase, c.calls) for c in pp.components]
    assert names == [("text_encoder", "before", 2), ("vae.decode", "after", 1)]
    cpu = Cluster.parse("2xcpu").devices[0]  # a core each
    ids = torch.zeros(1, 8, dtype=torch.long)
    alone = price_call(export_static(pipe.text_encoder, (ids,)), cpu)  # an independent price
    encoder = pp.components[0]
    assert encoder.cost.seconds == pytest.approx(alone.seconds)
    assert encoder.seconds == pytest.approx(2 * alone.seconds + encoder.transfer_seconds)
    assert pp.latency == pytest.approx(pp.transformer.latency + sum(c.seconds
                                                                    for c in pp.components))
    latent = example[0][0][:1]  # the VAE decodes one sample of the transformer's latent
    vae = price_call(export_static(pipe.vae, (latent,), method="decode"), cpu)
    assert pp.components[1].cost.matrix_flops == vae.matrix_flops > 0
    assert "text_encoder" in pp.summary() and "vae.decode" in pp.summary()
    without = _plan(pipe, example, "2xcpu", pp, decode=False)
    assert [c.name for c in without.components] == ["text_encoder"]


def _small(cluster: str, capacities: list[int]) -> Cluster:
    parsed = Cluster.parse(cluster)
    devices = [dataclasses.replace(d, memory=dataclasses.replace(d.memory, capacity=c))
               for d, c in zip(parsed.devices, capacities, strict=True)]
    return dataclasses.replace(parsed, devices=tuple(devices))


def test_a_component_goes_where_it_fits_or_is_refused_by_name(pixart) -> None:
    pipe, example, roomy = pixart
    encoder = roomy.components[0].cost
    need = encoder.weight_bytes + encoder.activation_bytes
    stage0 = next(s for s in roomy.transformer.stages if s.device_index == 0).memory_bytes
    stage1 = next(s for s in roomy.transformer.stages if s.device_index == 1).memory_bytes
    # device 0 keeps room for its stage only; the encoder goes to device 1 (and the VAE too)
    # (devices with their own memory: the cpu devices of a machine share one RAM, as
    # tests/unit/test_pipeline_memory.py checks)
    tight = _plan(pipe, example, _small("2xl40s", [stage0 + need // 2, 1 << 34]), roomy)
    assert tight.components[0].device_index == 1
    with pytest.raises(PlanInfeasible, match="text_encoder needs"):
        _plan(pipe, example, _small("2xl40s", [stage0 + need // 2, stage1 + need // 2]), roomy)


def test_with_no_degree_given_the_summary_names_the_mix_and_the_runner_up(pixart) -> None:
    """``plan_pipeline`` on 2 CPU devices, no degree given: the transformer's planner chooses
    among PipeFusion, CFG, Ulysses, Ring and TP by price, and the summary says which and
    what came second."""
    pipe, (args, kwargs), _ = pixart
    pp = plan_pipeline(pipe, args, kwargs, cluster="2xcpu", workload=STEPS, prompt_tokens=8,
                       encoder_calls=2)
    plan, text = pp.transformer, pp.summary()
    assert sum(st.group_size for st in plan.stages) <= 2 and plan.choice is not None
    assert plan.choice.searched + plan.choice.pruned > 1  # planned, or pruned by its bound
    assert plan.choice.runner_up and plan.choice.why
    assert f"runner-up: {plan.choice.runner_up}" in text


def test_bad_arguments_are_named_before_anything_is_planned(pixart) -> None:
    pipe, (args, kwargs), _ = pixart
    with pytest.raises(SpecError, match="encoder_calls=0"):
        plan_pipeline(pipe, args, kwargs, encoder_calls=0)
    packed = SimpleNamespace(transformer=pipe.transformer, vae=pipe.vae)  # a (B, N, C) latent
    with pytest.raises(SpecError, match="decode_latent="):
        plan_pipeline(packed, (args[0].flatten(2),), kwargs, workload=STEPS)
    untokenized = SimpleNamespace(transformer=pipe.transformer, text_encoder=pipe.text_encoder)
    with pytest.raises(SpecError, match="prompt_tokens="):
        plan_pipeline(untokenized, args, kwargs, workload=STEPS)


def test_a_square_latents_plan_prices_its_tokens_not_its_rows() -> None:
    """PixArt is captured with the latent's height as the axis and 4 patch columns per row
    (T = 4·s tokens): a plan of 4 patch rows is 16 tokens, one device's latency is the cost table's at 16 tokens
    (it was priced at 4: the row count)."""
    import tppc
    from tppc.cost_models.layer_costs import build_cost_table
    from tppc.examples import hf_pixart
    from tppc.frontend.front_end import capture_front_end

    model, args, kwargs = hf_pixart(size=8)
    plan = tppc.plan(model, args, kwargs, cluster="1xcpu", num_stages=1)
    assert (plan.seq_len, plan.tokens_per_unit, plan.seq_tokens) == (4, 4, 16)
    front = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    ctx = front.ctx
    table = build_cost_table(front.chunk, ctx.layers, "1xcpu", 16, seq_symbol=ctx.seq_symbol,
                             token_count=ctx.token_count)
    whole = sum(float(layer.time(16, 0)) for layer in table.layers[0])
    assert plan.latency == pytest.approx(whole, rel=1e-6)
