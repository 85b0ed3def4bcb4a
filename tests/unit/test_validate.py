"""Translation validation: ``tppc.compile`` checks the emitted program against the capture.

Every compile on real weights replays the program (two stages, two chunks or more, the example
and a probe length) against the unsplit captured graph; a difference raises SoundnessError
naming the first diverging node. The oracles: the eager model, and programs broken on purpose
at a known node (the error must name that node), and small models with constructs tppc got
wrong before (an ALiBi-style float bias, an in-place write into a slice), exact now.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tppc
from tests.oracles import assert_kernels_close, kernel_tolerance
from tppc import examples
from tppc.driver import emit
from tppc.validation.replay import compare
from tppc.validation.validate import validate_pipeline


def test_half_precision_rounding_passes_and_a_wrong_row_block_does_not() -> None:
    want = torch.randn(64, 256).to(torch.bfloat16)
    noise = (want.float() * (1 + 4e-3 * torch.randn(64, 256))).to(torch.bfloat16)
    assert not compare(noise, want).exceeds  # a chunked run's rounding (rel. norm ~5e-3)
    wrong = want.clone()
    wrong[40:] *= 1.1  # a third of the rows off by 10 %: what a lost bias or rope does
    assert compare(wrong, want).exceeds
    fp32 = torch.randn(64, 256)
    assert compare(fp32 + 2e-4 * fp32.abs().max(), fp32).exceeds  # fp32: 1e-4 of the max


def _chunked_and_staged(validation: tppc.validation.validate.Validation) -> bool:
    return any(len(r.chunks) >= 2 and len(r.stages) >= 2 for r in validation.runs)


def test_validation_passes_on_the_gpt_at_the_example_and_a_probe_length() -> None:
    model, (ids,), _ = examples.gpt(seq_len=32, n_layer=2)
    cp = tppc.compile(model, (ids,), executor="local")
    v = cp.validation
    assert v is not None and v.skipped is None
    assert len(v.lengths) == 2 and v.lengths[0] == 32 and v.lengths[1] != 32
    assert _chunked_and_staged(v)  # two stages although the plan may use one
    assert v.seconds > 0
    with torch.no_grad():
        want = model(ids)
        assert v.max_diff < kernel_tolerance(want)
        assert_kernels_close(cp(ids), want)


def test_validation_passes_on_the_dit_after_a_warm_up_pass() -> None:
    model, args, kwargs = examples.dit(size=8, depth=2)
    cp = tppc.compile(model, args, kwargs, executor="local")
    v = cp.validation
    assert len(v.lengths) == 2  # a dynamic capture: another patch-row count
    assert _chunked_and_staged(v) and any(r.warmup for r in v.runs)
    with torch.no_grad():
        assert v.max_diff < kernel_tolerance(model(*args, **kwargs))


def test_validation_passes_on_a_transformers_llama() -> None:
    model, (ids,), _ = examples.hf_llama(seq_len=16)
    cp = tppc.compile(model, (ids,), executor="local")
    assert _chunked_and_staged(cp.validation)
    with torch.no_grad():
        assert cp.validation.max_diff < kernel_tolerance(model(ids).logits)
    assert "validated" in cp.validation.summary()


def _scale_module_output(module_path: str, factor: float):
    """A partition pass that, after splitting, scales the value of the node made by
    ``module_path`` in the stage graphs only (meta kept, as a miscompiling pass would)."""
    original = emit.partition_stages

    def partition(ranges, names):
        inner = original(ranges, names)

        def broken_partition_pass(gm, ctx):
            out = inner(gm, ctx)
            for name, stage in out.named_children():
                if not name.startswith("stage_"):
                    continue
                for node in list(stage.graph.nodes):
                    stack = list((node.meta.get("nn_module_stack") or {}).values())
                    if node.op != "call_function" or not stack or stack[-1][0] != module_path:
                        continue
                    with stage.graph.inserting_after(node):
                        scaled = stage.graph.call_function(torch.ops.aten.mul.Tensor,
                                                           (node, factor))
                    scaled.meta = dict(node.meta)
                    node.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)
                stage.recompile()
            return out

        return broken_partition_pass

    return partition


@pytest.mark.parametrize("layer", ["blocks.0", "blocks.1"])
def test_a_program_broken_at_one_mlp_raises_soundness_error_naming_it(layer, monkeypatch):
    model, (ids,), _ = examples.gpt(seq_len=16, n_layer=2)
    monkeypatch.setattr(emit, "partition_stages", _scale_module_output(f"{layer}.mlp.2", 1.5))
    with pytest.raises(tppc.SoundnessError) as info:
        tppc.compile(model, (ids,), executor="local")
    err = info.value
    assert err.layer == layer and err.module == f"{layer}.mlp.2"
    assert err.op == "aten.linear.default" and err.max_diff > 1e-2
    assert f"module {layer}.mlp.2" in str(err) and "max |diff|" in str(err)


def test_verify_false_skips_validation(monkeypatch) -> None:
    model, (ids,), _ = examples.gpt(seq_len=16, n_layer=2)
    monkeypatch.setattr(emit, "partition_stages", _scale_module_output("blocks.1.mlp.2", 1.5))
    cp = tppc.compile(model, (ids,), executor="local", verify=False)
    assert cp.validation is None
    with torch.no_grad():  # the unchecked pipeline is wrong: what the check is for
        assert (cp(ids) - model(ids)).abs().max() > 1e-2


def test_a_model_on_the_meta_device_is_not_validated() -> None:
    with torch.device("meta"):
        model, _, _ = examples.gpt(seq_len=16, n_layer=2)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    v = validate_pipeline(None, model, (ids,))
    assert v.skipped is not None and "meta" in v.skipped and v.runs == ()


# -- constructs tppc got wrong before validation refused them: exact now -----------------------
class _Attention(nn.Module):
    def __init__(self, dim: int, construct: str, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.construct = heads, construct
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(heads)]))
        self.table = nn.Embedding(8, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2).contiguous()
                   for z in self.qkv(x).chunk(3, -1))
        if self.construct == "alibi":  # an additive float bias (ALiBi) as attn_mask
            i = torch.arange(t, device=x.device)
            rel = (i[None, :] - i[:, None]).to(x.dtype)
            mask = (self.slopes[:, None, None] * rel).masked_fill(i[None, :] > i[:, None],
                                                                   float("-inf"))
            return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                             .transpose(1, 2).reshape(b, t, d))
        if self.construct == "relative_bias":  # a learned bias per distance (T5-style)
            i = torch.arange(t, device=x.device)
            dist = (i[:, None] - i[None, :]).clamp(0, 7)
            mask = self.table(dist).permute(2, 0, 1).masked_fill(i[None, :] > i[:, None],
                                                                 float("-inf"))
            return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                             .transpose(1, 2).reshape(b, t, d))
        if self.construct == "slice_write":  # partial rotary: an in-place write into q[..., 4:]
            pos = torch.arange(t, device=x.device, dtype=x.dtype)[:, None]
            q[..., 4:] = q[..., 4:] * torch.cos(pos * 0.1) + 0.5 * torch.sin(pos * 0.1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _TopTwoRouting(nn.Module):
    """Mixture of experts whose routing mask is made by zeros_like and written by scatter_."""

    def __init__(self, dim: int, experts: int = 4) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(dim, experts), nn.Linear(dim, dim * experts)
        self.n = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)
        mask = torch.zeros_like(scores)
        mask.scatter_(-1, scores.topk(2, -1).indices, 1.0)
        out = self.experts(x).unflatten(-1, (self.n, -1))
        return (out * (scores * mask).unsqueeze(-1)).sum(-2)


class _Block(nn.Module):
    def __init__(self, dim: int, construct: str) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, construct)
        self.mlp = _TopTwoRouting(dim) if construct == "routing" else \
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Toy(nn.Module):
    """A causal LM of two blocks with the construct ``construct`` in each."""

    def __init__(self, construct: str, layers: int = 2, dim: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList(_Block(dim, construct) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("construct", ["slice_write", "routing", "alibi", "relative_bias"])
def test_constructs_refused_by_validation_before_are_now_exact(construct) -> None:
    """``q[..., 4:] = f(q[..., 4:])`` and ``zeros_like`` + ``scatter_`` were silently wrong
    (the writes were lost; capture now makes them out-of-place), and so were float attention
    biases (ALiBi, a learned table per distance: only which keys a query sees was kept; the
    chunk step now evaluates the bias' rows); validation refused them. Even ``verify=False``
    now matches the eager model."""
    model = _Toy(construct).eval()
    ids = torch.randint(0, 64, (1, 16))
    cp = tppc.compile(model, (ids,), executor="local", verify=False, num_stages=2, chunks=4)
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))
