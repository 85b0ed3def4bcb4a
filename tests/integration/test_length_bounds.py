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


class _TableBiasLM(nn.Module):
    """Our own LM whose bias tables hold 40 positions: torch.export bounds the length by
    them (``Min(40, L)`` rows, and ``L != 40``, where the slice is the whole table)."""

    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4, table: int = 40):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_TableBiasBlock(dim, heads, table) for _ in range(2))
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


_MODELS = {"xglm": _xglm, "mpt": _mpt, "table": _TableBiasLM}


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
