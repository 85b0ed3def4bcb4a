"""The model of ``test_distributed_mesh.py``'s jobs, as a factory every rank imports
(``tppc.launch("tests.integration.mesh_models:guided_dit", ...)``)."""

from __future__ import annotations

import torch

from tppc.examples.hf import dit


def guided_dit() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict]:
    """tppc's DiT (2 blocks, 8x8 latents) with a guided batch of two as its example."""
    model, _, _ = dit(size=8, depth=2)
    return model, (torch.zeros(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0])), {}
