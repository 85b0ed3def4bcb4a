"""A float mask over the joint ``[text | tokens]`` sequence, passed as an input (Chroma's
pipeline mask; issue 30): captured with its length as the text's plus the tokens and run by
its rows per chunk, added to the scores as eager SDPA adds it. The oracle is the eager model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc

TEXT = 4


class _Block(nn.Module):
    """One attention over ``[text | tokens]`` under ``m_i · m_j`` (a float 0/1 mask that SDPA
    adds: +1 on pairs of valid positions), as Chroma's blocks build it."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(h).chunk(3, dim=-1))
        mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return h + self.out(a.transpose(1, 2).reshape(b, t, d))


class _JointMaskModel(nn.Module):
    """Text joined before the tokens, two blocks, the tokens' part out."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(2))
        self.proj = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        h = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in self.blocks:
            h = block(h, attention_mask)
        return self.proj(h[:, encoder_hidden_states.shape[1]:])


def _inputs(tokens: int) -> tuple[tuple, dict]:
    mask = torch.ones(2, TEXT + tokens)
    mask[:, TEXT - 1] = 0  # a text pad
    mask[1, TEXT + 2] = 0.5  # a weighed image key: any value is added as it is
    return (torch.randn(2, tokens, 16),), {"encoder_hidden_states": torch.randn(2, TEXT, 16),
                                           "attention_mask": mask}


def test_a_joint_float_mask_runs_at_every_length_and_a_wrong_length_is_named() -> None:
    torch.manual_seed(0)
    model = _JointMaskModel().eval()
    cp = tppc.compile(model, *_inputs(6), num_stages=2)
    assert cp.context.joint_inputs == {"attention_mask": (1, TEXT)}
    for tokens in (6, 3):
        args, kwargs = _inputs(tokens)
        with torch.no_grad():
            torch.testing.assert_close(cp(*args, **kwargs), model(*args, **kwargs),
                                       rtol=0, atol=0)
    args, kwargs = _inputs(9)
    kwargs["attention_mask"] = kwargs["attention_mask"][:, :-1]
    with pytest.raises(tppc.RuntimeInputError, match=r"input 'attention_mask' axis 1 has 12 "
                       r"entries, but it spans the joint sequence: 4 context positions "
                       r"\(compiled\) \+ the call's 9 tokens = 13"):
        cp(*args, **kwargs)
