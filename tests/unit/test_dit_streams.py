"""DiT front end: context stream, prefix segments of joint attention, masks from example values."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tppc import examples
from tppc.ir.records import TOKEN


class _Joint(nn.Module):
    """MM-DiT in miniature: text tokens joined before the image tokens, masked by a text mask."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.img = nn.Linear(d, d)
        self.txt = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2))

    def forward(self, x: torch.Tensor, encoder_hidden_states: torch.Tensor,
                text_mask: torch.Tensor) -> torch.Tensor:
        n_text = encoder_hidden_states.shape[1]
        h, e = self.img(x), self.txt(encoder_hidden_states)
        keep = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
        mask = torch.cat([text_mask.bool(), keep], dim=1)[:, None, None, :]
        for block in self.blocks:
            joint = torch.cat([e, h], dim=1)
            q, k, v = block(joint).unsqueeze(1).chunk(3, dim=-1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)
            e, h = e + a[:, :n_text], h + a[:, n_text:]
        return h


def _joint():
    model = _Joint().eval()
    args = (torch.randn(1, 12, 16), torch.randn(1, 5, 16), torch.ones(1, 5))
    return model, args, tppc.annotate(model, args)


def test_text_inputs_are_the_context_stream() -> None:
    _, _, (_, ctx) = _joint()
    assert ctx.seq_inputs == {"x": (1,)}
    assert set(ctx.context_inputs) == {"encoder_hidden_states", "text_mask"}
    assert ctx.capture_mode == "dynamic"


def test_joint_attention_has_the_text_as_prefix() -> None:
    _, _, (gm, ctx) = _joint()
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(sdpa) == 2
    for node in sdpa:
        info = node.meta[TOKEN]
        assert info.role == "mixing" and info.attention == "bidirectional"
        assert info.prefix == 5
        assert info.axis_size.subs(ctx.seq_symbol, 12) == 17
    assert ctx.token_count.subs(ctx.seq_symbol, 12) == 12


def test_text_segment_after_joint_attention_is_prefix_only() -> None:
    _, _, (gm, _) = _joint()
    cut = [n.meta[TOKEN] for n in gm.graph.nodes if str(n.target) == "aten.slice.Tensor"
           and n.meta[TOKEN].role == "token"]
    text = [i for i in cut if i.prefix_only]
    image = [i for i in cut if not i.prefix_only]
    assert text and all(i.prefix == 5 and i.axis_size == 5 for i in text)
    assert image and all(i.prefix == 0 for i in image)


def test_text_mask_is_judged_from_its_example_values() -> None:
    # with zero-valued inputs the all-ones text mask would read as "allows 12 of 17 keys"
    _, _, (_, ctx) = _joint()
    assert [k for layer in ctx.layers for k in layer.attention_kinds] == ["bidirectional"] * 2


def test_joint_layers_forward_text_and_image_values() -> None:
    _, _, (gm, ctx) = _joint()
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1"]
    outs = {name: next(n for n in gm.graph.nodes if n.name == name).meta[TOKEN]
            for name in blocks[0].outputs}
    assert {i.prefix_only for i in outs.values()} == {False, True}  # text and image


class _Pool(nn.Module):
    """A text attention-pool (no token inputs) next to token self-attention."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 1, 1, d))
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        t = encoder_hidden_states[:, None]
        pooled = F.scaled_dot_product_attention(self.q, t, t).reshape(1, 1, -1)
        for block in self.blocks:
            h = block(x)[:, None]
            x = x + F.scaled_dot_product_attention(h, h, h).squeeze(1) + pooled
        return x


def test_attention_without_token_inputs_is_const() -> None:
    gm, _ = tppc.annotate(_Pool().eval(), (torch.randn(1, 6, 8), torch.randn(1, 3, 8)))
    roles = [n.meta[TOKEN].role for n in gm.graph.nodes
             if "scaled_dot_product" in str(n.target)]
    assert roles == ["const", "mixing", "mixing"]


def test_own_dit_records_its_patch_grid() -> None:
    model, args, _ = examples.dit(size=8)
    _, ctx = tppc.annotate(model, args)
    assert ctx.patch_size == 2 and ctx.patch_grid == (4, 4)
    assert ctx.specialized_to is None and ctx.context_inputs == ()
    assert ctx.token_count.subs(ctx.seq_symbol, 4) == 16
