"""The fake forward's verdict (tppc/frontend/shape_check.py): sizes a model refuses, and
checks that only a fake tensor fails (a meta kernel's dtype requirement written for another
device's kernel: ``_grouped_mm`` wants bfloat16 there; its CPU kernel takes float32)."""

from __future__ import annotations

import torch
from torch import nn

from tppc.frontend.shape_check import fake_forward


class _GroupedExperts(nn.Module):
    """Rows grouped by expert through ``torch._grouped_mm`` in float32 (transformers'
    ``grouped_mm`` experts implementation on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        return torch._grouped_mm(x, self.weight, offs=offs)


def test_a_meta_dtype_requirement_is_no_refusal_of_the_sizes() -> None:
    model, x = _GroupedExperts(), torch.randn(8, 4)
    assert model(x).shape == (8, 4)  # the CPU kernel takes float32
    refusal, _ = fake_forward(model, (x,), {})
    assert refusal is None


def test_wrong_sizes_are_still_a_refusal() -> None:
    refusal, _ = fake_forward(nn.Linear(4, 4), (torch.randn(3, 5),), {})
    assert isinstance(refusal, RuntimeError)
