"""Examples: the project's own models (``models``: GPT, DiT), model factories (``hf``), the
factory loader (``factory``) and the demo (``demo``).

A factory returns ``(model, example_args, example_kwargs)`` with random weights; the CLI
takes one as ``tppc.examples:NAME`` (e.g. ``tppc.examples:gpt``).
The factories load lazily (``import tppc.examples.factory`` needs no torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["dit", "gpt", "hf_cogvideox", "hf_dit", "hf_flux", "hf_gemma3", "hf_gpt2", "hf_hunyuan_dit", "hf_hunyuan_video", "hf_llama", "hf_mamba2", "hf_mistral", "hf_mixtral", "hf_pixart", "hf_qwen3", "hf_sd3"]


def __getattr__(name: str) -> Any:
    """``tppc.examples.NAME``: the factory ``NAME`` of :mod:`tppc.examples.hf` (imported lazily)."""
    if name in __all__:
        from tppc.examples import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'tppc.examples' has no attribute {name!r}")
