"""Fixtures shared by the distributed integration tests."""

from __future__ import annotations

import pytest

from tppc.distributed.checkpoint import save_checkpoint
from tppc.examples import gpt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The project's GPT (``tppc.examples.gpt``) saved as a safetensors checkpoint."""
    model, _, _ = gpt()
    path = tmp_path_factory.mktemp("ckpt") / "gpt.safetensors"
    save_checkpoint(model, path)
    return str(path)
