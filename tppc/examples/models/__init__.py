"""Small reference models written in this project: a causal GPT and a DiT."""

from __future__ import annotations

from tppc.examples.models.dit import DiT, DiTConfig
from tppc.examples.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "DiT", "DiTConfig", "GPTConfig"]
