"""transformers' DBRX, JetMoE and Doge: exact where the model's construct allows, else refused
naming the construct, the model's line and a fix that works (issue 31).

DBRX's eager experts loop over the experts the routing hit (``for expert_idx in expert_hit``,
``modeling_dbrx.py:296``; DBRX has no ``experts_implementation``): a loop of data-dependent
length that torch.export cannot trace. The refusal names the fix, a loop over every expert, and
that fix is exact here: each expert's rows (``torch.where(expert_mask[e])``) are a
data-dependent count that tppc captures and prices at its bound. The fix is applied to this
test's model instance only (its experts' class swapped), as a user would.

JetMoE's mixture of attention sorts the tokens by expert in ``map`` (before the attention) and
reads that order again in ``reduce`` (after it): refused naming the module on both sides of the
attention and the fix, routing row by row (each token's experts' weights gathered), which is
exact here with JetMoE's own MoE kept (its sort within one module is a row-wise region; its
experts' rows, ``expert_size.tolist()`` split sizes, are priced at the axis they split). Doge's dynamic mask (a bias per key from ``dt_proj`` of the values,
``modeling_doge.py:305``) is refused at every ``keep_window_size``: the top-k beyond the window
is not what stops it, so a window as long as the sequence is no fix.

CI runs the same two MoE loops on a tiny model of our own (a second or two per compile less than
DBRX's): the loop over the experts hit refused with the fix named, the loop over every expert
exact at 2 stages.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.errors import ActivationMaskError, AnnotationError, CaptureError
from tppc.planner.manual import manual_plan

T = pytest.importorskip("transformers")

LENGTH = 24
BOUNDS = (0, 8, 16, 24)


def _dbrx() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
                       attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                       ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
                       use_cache=False, pad_token_id=0, attn_implementation="sdpa")
    return T.DbrxForCausalLM(cfg).eval()


def _every_expert(model: torch.nn.Module) -> torch.nn.Module:
    """The refusal's fix on ``model``'s experts: a loop over every expert, not the ones hit."""
    from transformers.models.dbrx.modeling_dbrx import DbrxExperts

    class EveryExpert(DbrxExperts):
        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            batch = hidden_states.shape[0]
            rows = hidden_states.reshape(-1, self.hidden_size)
            out = torch.zeros_like(rows)
            mask = torch.nn.functional.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)
            split = (-1, self.ffn_hidden_size, self.hidden_size)
            for e in range(self.num_experts):
                slot, token = torch.where(mask[e])
                w1, v1, w2 = (w.view(split)[e] for w in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
                states = self.mlp(rows[token], w1, v1, w2) * top_k_weights[token, slot, None]
                out.index_add_(0, token, states)
            return out.view(batch, -1, self.hidden_size)

    for module in model.modules():
        if type(module) is DbrxExperts:
            module.__class__ = EveryExpert
    return model


class _LoopMoE(nn.Module):
    """An eager mixture of experts, its loop over the experts hit or over every expert."""

    def __init__(self, every: bool, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, 2 * d, d) * 0.2)
        self.w_out = nn.Parameter(torch.randn(experts, d, 2 * d) * 0.2)
        self.every = every

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(rows).softmax(-1), 2, dim=-1)
        mask = F.one_hot(index, self.w_in.shape[0]).permute(2, 1, 0)
        hit = range(self.w_in.shape[0]) if self.every else mask.sum((-1, -2)).nonzero()[:, 0]
        out = torch.zeros_like(rows)
        for e in hit:
            slot, token = torch.where(mask[e])
            h = F.silu(rows[token] @ self.w_in[e].T) @ self.w_out[e].T
            out.index_add_(0, token, h * weights[token, slot, None])
        return out.view_as(x)


class _Block(nn.Module):
    """Causal attention, then the MoE."""

    def __init__(self, every: bool, d: int) -> None:
        super().__init__()
        self.qkv, self.o, self.moe = nn.Linear(d, 3 * d), nn.Linear(d, d), _LoopMoE(every, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
        return x + self.moe(x)


class _LoopMoELM(nn.Module):
    """Embedding, one block, head."""

    def __init__(self, every: bool, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList([_Block(every, d)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](self.emb(ids)))


def test_own_loop_over_the_experts_hit_is_refused_naming_the_fix() -> None:
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"(?s)data-dependent length.*range\(num_experts\)"):
        tppc.compile(_LoopMoELM(every=False).eval(), (torch.randint(0, 32, (1, 8)),),
                     num_stages=2, chunks=2)


def test_own_loop_over_every_expert_is_exact_at_two_stages() -> None:
    torch.manual_seed(0)
    model = _LoopMoELM(every=True).eval()
    cp = tppc.compile(model, (torch.randint(0, 32, (1, 8)),), num_stages=2, chunks=2)
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 8, cuts=(0, n // 2, n), boundaries=(0, 3, 8)))
    with torch.no_grad():
        x = torch.randint(0, 32, (1, 8))
        assert_kernels_close(staged(x), model(x))


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def test_dbrx_loop_over_the_experts_hit_is_refused_naming_the_loop_and_the_fix() -> None:
    with pytest.raises(CaptureError) as err:
        tppc.compile(_dbrx(), (_ids(LENGTH),), {"use_cache": False}, num_stages=2, chunks=3)
    text = str(err.value)
    assert "modeling_dbrx.py:296" in text and "for expert_idx in expert_hit" in text
    assert "data-dependent length" in text and "range(num_experts)" in text


@pytest.fixture(scope="module")
def dbrx_fixed() -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    """DBRX with the fix, compiled at 2 stages (re-planned per length)."""
    model = _every_expert(_dbrx())
    return model, tppc.compile(model, (_ids(LENGTH),), {"use_cache": False}, num_stages=2,
                               chunks=3)


def test_dbrx_with_the_named_fix_is_exact_at_two_stages(dbrx_fixed) -> None:
    model, cp = dbrx_fixed
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, LENGTH, cuts=(0, n // 2, n), boundaries=BOUNDS))
    with torch.no_grad():
        x = _ids(LENGTH, seed=3)
        assert_kernels_close(staged(x).logits, model(x).logits)
        longer = _ids(LENGTH + 8, seed=4)  # re-planned: its routing hits other rows
        assert len(cp.program(LENGTH + 8).plan.stages) == 2
        assert_kernels_close(cp(longer).logits, model(longer).logits)


def test_dbrx_with_the_named_fix_generates_the_eager_greedy_tokens(dbrx_fixed) -> None:
    model, cp = dbrx_fixed
    prompt = _ids(12, seed=1)
    want = greedy_reference(lambda x: model(x).logits, prompt, 4)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), want)


def _jetmoe(dense: bool) -> torch.nn.Module:
    from transformers.models.jetmoe import modeling_jetmoe as mj

    torch.manual_seed(0)
    cfg = T.JetMoeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, kv_channels=8,
                         num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=256, use_cache=False,
                         pad_token_id=0, attn_implementation="sdpa")
    model = T.JetMoeForCausalLM(cfg).eval()
    for module in model.modules() if dense else ():
        if type(module) is mj.JetMoeMoA:  # its MoE (a sort within one module) stays as is
            module.__class__ = _RowWiseMoA
    return model


def _route(router: torch.nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = router.layer(rows).float()
    top, index = logits.topk(router.top_k, dim=1)
    return logits, index, torch.softmax(top, dim=1).type_as(rows)


def _experts(rows: torch.Tensor, weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's rows through its own experts: ``(tokens, k, ...)`` rows, no sort."""
    pattern = "th,tkoh->tko" if rows.dim() == 2 else "tkh,tkoh->tko"
    return torch.einsum(pattern, rows, weight[index])


def _row_wise_classes() -> type:
    """JetMoE's mixture of attention written with the refusal's fix (weights gathered per
    token)."""
    from transformers.models.jetmoe import modeling_jetmoe as mj

    class RowWiseMoA(mj.JetMoeMoA):
        def map(self, x: torch.Tensor) -> tuple:
            rows = x.reshape(-1, x.shape[-1])
            logits, index, gates = _route(self.router, rows)
            q = _experts(rows, self.input_linear.weight, index)
            return q.view(*x.shape[:2], self.top_k, -1), logits, (index, gates)

        def reduce(self, a: torch.Tensor, topo: tuple) -> torch.Tensor:
            index, gates = topo
            out = _experts(a.reshape(-1, *a.shape[2:]), self.output_linear.weight, index)
            return (out * gates[..., None]).sum(1).view(*a.shape[:2], -1) + self.bias

    return RowWiseMoA


_RowWiseMoA = _row_wise_classes()


def test_jetmoe_mixture_of_attention_is_refused_naming_both_sides_and_the_fix() -> None:
    with pytest.raises(AnnotationError) as err:
        tppc.compile(_jetmoe(dense=False), (_ids(LENGTH),), {"use_cache": False},
                     num_stages=2, chunks=3)
    text = str(err.value)
    assert "'model.layers.0.self_attention.experts' runs on both sides of the attention" in text
    assert "modeling_jetmoe.py:199" in text and "weight[top_k_indices]" in text


def test_jetmoe_with_the_named_fix_is_exact_at_two_stages_and_generates() -> None:
    model = _jetmoe(dense=True)
    with torch.no_grad():  # the fix computes what JetMoE's own code computes
        x = _ids(LENGTH, seed=3)
        assert_kernels_close(model(x).logits, _jetmoe(dense=False)(x).logits)
    cp = tppc.compile(model, (_ids(LENGTH),), {"use_cache": False}, num_stages=2, chunks=3)
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, LENGTH, cuts=(0, n // 2, n), boundaries=BOUNDS))
    with torch.no_grad():
        assert_kernels_close(staged(x).logits, model(x).logits)
    prompt = _ids(12, seed=1)
    want = greedy_reference(lambda ids: model(ids).logits, prompt, 4)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), want)


@pytest.mark.parametrize("window", [16, 2048])
def test_doge_dynamic_mask_is_refused_at_any_keep_window_size(window: int) -> None:
    torch.manual_seed(0)
    cfg = T.DogeConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                       keep_window_size=window, use_cache=False, pad_token_id=0,
                       attn_implementation="sdpa")
    with pytest.raises(ActivationMaskError, match=r"enter it at .*modeling_doge\.py:296"):
        tppc.compile(T.DogeForCausalLM(cfg).eval(), (_ids(LENGTH),), {"use_cache": False},
                     num_stages=2, chunks=3)
