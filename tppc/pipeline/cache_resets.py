"""Where transformers' ``generate`` drops the K/V cache and recomputes the whole sequence.

Terms:
    cache reset: Phi-3, PhiMoE and Phi-4-multimodal override ``prepare_inputs_for_generation``
        so that the decode step whose input first has ``original_max_position_embeddings + 1``
        tokens runs without the cache: longrope switches from its short to its long factors
        there, and every position is computed again with the long ones (the short-factor
        K/V computed so far are dropped). Other models keep their cache (a dynamic-NTK rope's
        cached K keep the frequencies they were computed with).

:func:`cache_reset_length` reads that rule from the model (its class's own
``prepare_inputs_for_generation`` and its config), so that :func:`tppc.pipeline.generate.
greedy_generate` runs a prefill of the whole sequence at that step, as transformers does.

Example:
    >>> cache_reset_length(phi3)           # doctest: +SKIP
    17
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["cache_reset_length"]

_FIELD = "original_max_position_embeddings"


def cache_reset_length(model: torch.nn.Module) -> int | None:
    """The number of tokens at which the model's ``generate`` recomputes the sequence
    without its cache (``original_max_position_embeddings + 1``), or None."""
    prepare = getattr(type(model), "prepare_inputs_for_generation", None)
    limit = getattr(getattr(model, "config", None), _FIELD, None)
    if prepare is None or not isinstance(limit, int):
        return None
    try:
        source = inspect.getsource(prepare)
    except (OSError, TypeError):
        return None
    return limit + 1 if f"{_FIELD} + 1" in source and "= None" in source else None
