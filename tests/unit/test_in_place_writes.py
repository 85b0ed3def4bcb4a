"""In-place writes keep their meaning: capture functionalises them (issue 18, item 2).

Values made inside the graph (``clone``, ``new_zeros``, ``empty_like``) and then written in
place through views (slice assignment, ``index_put_``, ``fill_`` on a view, ``copy_``) are one
chain of out-of-place values after capture; the pipeline equals the eager model (the oracle)
with two stages and uneven chunks, with validation off so the emitted program alone decides.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn import functional as F

import tppc
from tppc.passes.annotation.positional import call_target


class _WrittenKeys(nn.Module):
    """Attention whose keys are assembled in place: ``empty_like`` + two ``copy_`` into halves,
    a position-dependent scale written by ``index_put_`` into every other feature, ``fill_`` on a column."""

    def __init__(self, d: int = 24, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in
                   self.qkv(x).chunk(3, -1))
        half = k.shape[-1] // 2
        k2 = torch.empty_like(k)
        k2[..., :half].copy_(k[..., half:])
        k2[..., half:].copy_(-k[..., :half])
        cols = torch.arange(1, k.shape[-1], 2, device=x.device)
        pos = torch.arange(t, device=x.device).to(x.dtype)[:, None]
        k2[..., cols] = k2[..., cols] * (1.0 + 0.01 * pos)  # index_put_ on the features
        k2[..., 0].fill_(0.25)
        y = F.scaled_dot_product_attention(q, k2, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class _Toy(nn.Module):
    def __init__(self, layers: int = 2, vocab: int = 40, d: int = 24) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(_WrittenKeys(d) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            buf = x.new_zeros(x.shape)
            buf[:, :, 1:] = block(x)[:, :, 1:]  # slice assignment into a new_zeros buffer
            x = buf + x[:, :, :1].clone().fill_(0.0)
        return self.head(x)


def test_writes_through_views_of_values_made_in_the_graph_are_exact() -> None:
    torch.manual_seed(0)
    model = _Toy().eval()
    ids = torch.randint(0, 40, (1, 13))
    cp = tppc.compile(model, (ids,), executor="local", verify=False, num_stages=2, chunks=3)
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(cp(ids), want, rtol=1e-4, atol=1e-4)
        short = ids[:, :9]
        torch.testing.assert_close(cp(short), model(short), rtol=1e-4, atol=1e-4)


def test_the_default_compile_validates_the_same_model() -> None:
    torch.manual_seed(1)
    model = _Toy().eval()
    ids = torch.randint(0, 40, (1, 12))
    cp = tppc.compile(model, (ids,), executor="local", num_stages=2, chunks=4)
    assert cp.validation.max_diff < 1e-4


def test_a_probe_reads_an_uninitialised_tensor_as_zeros() -> None:
    """Annotation probes (mask classification, MoE exactness checks) run ``new_empty`` and
    friends; they must not read whatever memory held (the DeepSeekV3 nondeterminism)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.new_empty.default, (x, [64, 64]))
    for _ in range(3):
        got = call_target(node, (torch.full((2,), float("nan")), [64, 64]), {})
        assert torch.equal(got, torch.zeros(64, 64))
