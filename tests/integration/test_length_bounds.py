"""Models whose Python branches on the length, or that run at no longer length than a table.

XGLM (eager attention only: its logits clamped to the dtype's minimum, scores in a
``(batch·heads)`` layout) grows its sinusoidal table past ``max_position_embeddings`` in a
Python branch; MPT slices an ALiBi table of ``max_seq_len`` rows by the length; our own model
slices learned bias tables of 40 rows (torch.export also excludes 40 itself). Each is exact inside the lengths its capture holds
and refused by name outside (was: "the sequence length was fixed to its example value",
or a raw shape error from a mask probe).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tppc
from tests.oracles import assert_kernels_close
from tppc.errors import RuntimeInputError

transformers = pytest.importorskip("transformers")


def _xglm() -> nn.Module:
    return transformers.XGLMForCausalLM(transformers.XGLMConfig(
        vocab_size=128, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, attn_implementation="eager", use_cache=False))


def _mpt() -> nn.Module:
    return transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=128, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
        attn_implementation="eager", use_cache=False))


def _gpt_neo() -> nn.Module:
    """Eager attention only; its causal (and local: a window of 8) mask is a bool table of
    ``max_position_embeddings`` rows sliced by the length, applied as ``where(mask, s, min)``."""
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=8, use_cache=False,
        attn_implementation="eager"))


class _TableBiasBlock(nn.Module):
    """Attention with a learned ``(heads, 40, 40)`` bias table sliced ``[:, :L, :L]``."""

    def __init__(self, dim: int, heads: int, table: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(heads, table, table))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        pos = torch.arange(length, device=x.device)
        causal = pos[:, None] >= pos[None, :]
        bias = self.bias[:, :length, :length].masked_fill(~causal, float("-inf"))
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + y.transpose(1, 2).reshape(b, length, dim)


class _BlocksLM(nn.Module):
    """Our own LM: an embedding, two blocks made by ``block``, a head."""

    def __init__(self, block: Callable[[], nn.Module], vocab: int = 128, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _table_bias_lm() -> nn.Module:
    """Bias tables of 40 positions: torch.export bounds the length by them (``Min(40, L)``
    rows, and ``L != 40``, where the slice is the whole table)."""
    return _BlocksLM(lambda: _TableBiasBlock(32, 4, 40))


class _WhereFloorBlock(nn.Module):
    """Our own eager attention in the forms XGLM and GPT-Neo use: scores in a ``(b·h)``
    layout, ``where(causal, s, finfo.min)`` and a floor ``max(s, finfo.min)``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        q, k, v = (t.reshape(b, length, self.heads, -1).transpose(1, 2)
                   .reshape(b * self.heads, length, -1) for t in self.qkv(x).chunk(3, -1))
        scores = torch.bmm(q, k.transpose(1, 2)) / (dim // self.heads) ** 0.5
        pos = torch.arange(length, device=x.device)
        low = torch.full((), torch.finfo(scores.dtype).min)
        scores = torch.where(pos[:, None] >= pos[None, :], scores, low)
        scores = torch.max(scores, low)
        y = torch.bmm(scores.softmax(-1), v).view(b, self.heads, length, -1)
        return x + y.transpose(1, 2).reshape(b, length, dim)


def test_own_eager_attention_with_where_and_a_floor_is_folded_and_exact() -> None:
    torch.manual_seed(0)
    model = _BlocksLM(_WhereFloorBlock).eval()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    assert cp.context.length_bound is None and cp.context.length_limit is None
    with torch.inference_mode():
        for length in (24, 100):
            x = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(1))
            assert_kernels_close(cp(x), model(x), depth=4)


_MODELS = {"xglm": _xglm, "mpt": _mpt, "gpt_neo": _gpt_neo, "table": _table_bias_lm}


@functools.cache
def _compiled(name: str) -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _MODELS[name]().eval()
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    return model, tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize(("name", "inside", "outside", "says"), [
    ("xglm", (24, 64), 80, ["captured for 2 to 64 tokens", "modeling_xglm.py:102"]),
    ("mpt", (24, 64), 70, ["runs at no more than 64", "does not evaluate at 66 tokens"]),
    ("gpt_neo", (24, 63), 64, ["captured for 2 to 63 tokens", "modeling_gpt_neo.py:116"]),
    ("table", (24, 39), 40, ["captured for 2 to 39 tokens"]),
])
def test_exact_inside_the_captured_lengths_and_refused_by_name_outside(
        name: str, inside: tuple[int, ...], outside: int, says: list[str]) -> None:
    model, cp = _compiled(name)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for length in inside:
            ids = torch.randint(3, 128, (1, length), generator=gen)
            assert_kernels_close(_logits(cp(ids)), _logits(model(ids)), depth=4)
        with pytest.raises(RuntimeInputError) as err:
            cp(torch.randint(3, 128, (1, outside), generator=gen))
    assert f"has {outside} tokens" in str(err.value)
    for text in says:
        assert text in str(err.value)


def test_generate_past_the_model_limit_is_refused_before_it_runs() -> None:
    model, cp = _compiled("mpt")
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeInputError, match="max_new_tokens=8 has 68 tokens"):
        cp.generate(ids, max_new_tokens=8)
    got = cp.generate(ids, max_new_tokens=4)  # 64 tokens: the whole table
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False,
                                           attention_mask=torch.ones_like(ids)))
