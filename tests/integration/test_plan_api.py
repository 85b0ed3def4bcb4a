"""tppc.plan on models built on the meta device, and block reuse during capture."""

from __future__ import annotations

import pytest
import torch

from tppc.driver.planning import plan
from tppc.frontend.annotate import annotate
from tppc.frontend.blocks import expand_layers, few_blocks

transformers = pytest.importorskip("transformers")


def _meta_llama(layers: int = 6):
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=8,
                                   num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    return model, (torch.randint(0, 1000, (1, 64)),)


def test_plan_a_meta_model_without_weights() -> None:
    model, args = _meta_llama()
    p = plan(model, args, cluster="4xh100-sxm", seq_len=4096, granularity=256,
             tensor_parallel=1)
    assert p.num_stages == 4
    assert sum(b - a for a, b in p.chunks) == 4096
    assert p.latency >= p.lower_bound > 0
    assert all(w.device.type == "meta" for w in model.parameters())


def test_few_blocks_restores_the_model_and_expands_layers() -> None:
    model, args = _meta_llama(layers=6)
    with few_blocks(model) as truncated:
        assert len(model.model.layers) == 2
        _, ctx = annotate(model, tuple(a.to("meta") for a in args))
    assert len(model.model.layers) == 6
    assert truncated == ("model.layers", 6)
    layers = expand_layers(ctx.layers, *truncated)
    assert [layer.name for layer in layers if layer.kind == "block"] == \
        [f"model.layers.{i}" for i in range(6)]
    assert [layer.index for layer in layers] == list(range(len(layers)))


def test_block_reuse_gives_the_same_layer_table_as_full_capture() -> None:
    model, args = _meta_llama(layers=4)
    meta_args = tuple(a.to("meta") for a in args)
    _, full = annotate(model, meta_args)
    with few_blocks(model) as truncated:
        _, short = annotate(model, meta_args)
    reused = expand_layers(short.layers, *truncated)
    strip = [(layer.name, layer.kind, layer.param_count, layer.param_bytes,
              layer.attention_kinds) for layer in reused]
    assert strip == [(layer.name, layer.kind, layer.param_count, layer.param_bytes,
                      layer.attention_kinds) for layer in full.layers]


def test_models_with_per_layer_attention_types_are_not_truncated() -> None:
    model, _ = _meta_llama(layers=4)
    model.config.layer_types = ["sliding_attention", "full_attention"] * 2
    with few_blocks(model) as truncated:
        assert truncated is None
        assert len(model.model.layers) == 4


def test_dit_blocks_win_over_a_numbered_sequential_when_truncated() -> None:
    from tppc import examples

    model, args, _ = examples.dit(size=16)
    with few_blocks(model) as truncated:
        _, ctx = annotate(model, args)
    layers = expand_layers(ctx.layers, *truncated)
    assert [layer.name for layer in layers if layer.kind == "block"] == \
        [f"blocks.{i}" for i in range(4)]


def test_diffusion_plan_prices_every_stage() -> None:
    from tppc import examples
    from tppc.planner import Workload

    model, args, _ = examples.dit(size=32)
    p = plan(model, args, cluster="4xa100-80gb@pcie4",
             workload=Workload(kind="diffusion", steps=20, warmup_steps=1))
    busy = [sum(e - s for s, e in zip(p.start[i], p.end[i])) for i in range(p.num_stages)]
    assert all(b > 0 for b in busy)
