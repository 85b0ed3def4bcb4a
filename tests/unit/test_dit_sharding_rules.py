"""The sharding rules diffusion transformers need, on tiny graphs (``torch.export``, no compile).

Each module is a construct of a DiT block written out: an adaLN modulation, a fused QKV
unflattened and unbound, a single-stream block that joins the attention output and the MLP
columns before one projection, an interleaved rotary embedding (``unbind`` / ``stack``), a
padded value (Sana's linear attention). The oracle is what Megatron-LM's pairing says each
linear must be (column, row, or whole for a stated reason).
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F
from torch import nn

from tppc.passes.sharding.annotate_shards import analyse
from tppc.passes.sharding.reshapes import reshape_groups

D, HEADS, HD = 8, 2, 4


def _roles(model: nn.Module, *args: torch.Tensor) -> tuple[dict[str, tuple], dict[str, str]]:
    """``{module path: (role, segments)}`` of every linear, and the notes by module path."""
    gm = torch.export.export(model.eval(), args).module()
    result = analyse(gm)
    names = {n.name: n for n in gm.graph.nodes}

    def path(node: torch.fx.Node) -> str:
        return str(node.args[1].target).rsplit(".", 1)[0]

    roles = {path(n): (r.kind, r.segments) for n, r in result.roles.items()
             if n.target == torch.ops.aten.linear.default}
    return roles, {path(names[o]): why for o, why in result.notes}


class _Modulated(nn.Module):
    """adaLN-zero: shift/scale from the conditioning vector; a fused QKV unbound by pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.ada = nn.Linear(D, 2 * D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D, elementwise_affine=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(F.silu(c)).unsqueeze(1).chunk(2, -1)
        h = self.norm(x) * (1 + scale) + shift
        q, k, v = self.qkv(h).unflatten(-1, (3, HEADS, HD)).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        return x + self.out(a.transpose(1, 2).flatten(2))


def test_a_modulation_leaves_its_linear_whole_and_the_attention_is_cut() -> None:
    roles, notes = _roles(_Modulated(), torch.randn(1, 5, D), torch.randn(1, D))
    assert roles["qkv"] == ("column", (D, D, D))  # refined into q, k, v by the unbind
    assert roles["out"] == ("row", (D,))
    assert roles["ada"][0] == "replicated"
    assert "a modulation" in notes["ada"]


class _SingleStream(nn.Module):
    """A Flux-like single block: attention beside MLP columns, one projection of both."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.mlp = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(D + 2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, HD).transpose(1, 2)
                   for t in self.qkv(x).split(D, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, D)
        return x + self.proj(torch.cat([a, F.gelu(self.mlp(x))], dim=2))


def test_a_concatenation_along_the_cut_axis_feeds_one_row_parallel_projection() -> None:
    roles, notes = _roles(_SingleStream(), torch.randn(1, 5, D))
    assert roles["proj"] == ("row", (D, 2 * D))  # segments: the heads, then the MLP columns
    assert roles["mlp"] == ("column", (2 * D,))
    assert not notes


class _Rotary(nn.Module):
    """An interleaved rotary embedding on cut heads (pairs unbound, rotated, stacked)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, HD).transpose(1, 2)
        real, imag = q.reshape(b, HEADS, n, HD // 2, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(3)
        q = q * cos + rotated * sin
        return self.out(q.transpose(1, 2).reshape(b, n, D))


def test_an_interleaved_rotary_embedding_keeps_the_heads_cut() -> None:
    roles, notes = _roles(_Rotary(), torch.randn(1, 5, D), torch.randn(5, HD),
                          torch.randn(5, HD))
    assert roles == {"q": ("column", (D,)), "out": ("row", (D,))} and not notes


class _PaddedValue(nn.Module):
    """Sana's linear attention: the value padded with a row of ones, ``v @ k^T`` per head."""

    def __init__(self, pad_heads: bool = False) -> None:
        super().__init__()
        self.k, self.v, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.pad_heads = pad_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        k = self.k(x).view(b, n, HEADS, HD).permute(0, 2, 3, 1)  # b, h, d, n
        v = self.v(x).view(b, n, HEADS, HD).permute(0, 2, 3, 1)
        pad = (0, 0, 0, 0, 0, 1) if self.pad_heads else (0, 0, 0, 1)
        v = F.pad(v, pad, value=1.0)[:, :HEADS]  # (padding the heads: a head of ones, dropped)
        kv = torch.matmul(v, k.transpose(-1, -2))  # b, h, d + 1, d
        return self.out(kv[:, :, :HD].sum(-1).reshape(b, 1, D).expand(b, n, D))


def test_padding_keeps_a_cut_unless_it_pads_the_cut_axis() -> None:
    roles, _ = _roles(_PaddedValue(), torch.randn(1, 5, D))
    assert roles["k"][0] == roles["v"][0] == "column" and roles["out"][0] == "row"
    roles, notes = _roles(_PaddedValue(pad_heads=True), torch.randn(1, 5, D))
    assert roles["v"][0] == "replicated" and "pads the cut axis" in notes["v"]


def test_token_axis_sizes_that_differ_by_a_constant_are_one_axis() -> None:
    """A later patch's graph keeps the first patch's text rows in the shapes it recorded."""
    s = sympy.Symbol("s")
    assert reshape_groups((1, s, 2, 8), (1, s + 6, 2, 4, 2)) == [
        ([1], [1]), ([2], [2]), ([3], [3, 4])]
    assert reshape_groups((1, s, 8), (1, 2 * s + 1, 4)) == []  # not one axis: no group


class _NormAcrossHeads(nn.Module):
    """A q norm over every head (Wan's ``rms_norm_across_heads``) written into ``empty_like``
    by an interleaved rotary embedding, ``type_as`` the query."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(D, 2 * D if fused else D), nn.Linear(D, D)
        self.norm, self.fused = nn.RMSNorm(D), fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        q = self.norm(q.split(D, -1)[0] if self.fused else q).unflatten(-1, (HEADS, HD))
        rotated = torch.empty_like(q)
        rotated[..., 0::2] = -q[..., 1::2]
        rotated[..., 1::2] = q[..., 0::2]
        return self.out((q + rotated).flatten(2).type_as(x))


def test_a_norm_over_every_head_of_one_projection_sums_its_statistics_over_the_group() -> None:
    roles, notes = _roles(_NormAcrossHeads(), torch.randn(1, 5, D))
    assert roles == {"q": ("column", (D,)), "out": ("row", (D,))} and not notes
    roles, notes = _roles(_NormAcrossHeads(fused=True), torch.randn(1, 5, D))
    assert roles["q"][0] == "replicated" and "normalises over the cut axis" in notes["q"]
