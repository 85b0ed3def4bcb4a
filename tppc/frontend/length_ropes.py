"""Rotary embeddings whose frequencies depend on the call's length, captured per call.

Terms:
    length rope: a rotary module of transformers whose ``forward`` is wrapped by
        ``dynamic_rope_update`` (``modeling_rope_utils.py``; Llama, Qwen2, Mistral, Phi-3...
        share the ``*RotaryEmbedding`` with ``rope_type``) with a ``"dynamic"`` rope type
        (dynamic NTK). Eagerly it keeps state: when ``seq_len = max(position_ids) + 1``
        passes the longest length it has seen it recomputes ``inv_freq`` with
        ``rope_init_fn(config, device, seq_len=seq_len)`` and keeps it; below the original
        ``max_position_embeddings`` it puts ``original_inv_freq`` back. The branch reads
        tensor values, so torch.export cannot trace it.
    stateless form: what that forward computes in one call from a fresh module (and in
        every call whose length is not below a longer one seen before): the frequencies of
        ``seq_len = max(position_ids) + 1`` when it passes the original maximum, else the
        original ones, written as tensor ops
        (``where(seq_len > original, rope_init_fn(..., seq_len=seq_len), original_inv_freq)``,
        the module's own ``rope_init_fn`` on a tensor length). The capture of the shadow
        tree (:mod:`tppc.frontend.isolation`) runs this form, so the frequency table is a
        value of the call: with positions from the length it is a positional value,
        evaluated once per call at the call's whole length (never at a chunk's); with
        ``position_ids`` passed, it is computed from that input whole.

``longrope`` (Phi-3) is not rewritten: its update is already a ``torch.where`` on
``max(position_ids) + 1``.

Example:
    >>> stateless_length_ropes(shadow)       # doctest: +SKIP
    ('model.rotary_emb',)
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tppc.errors import CaptureError

__all__ = ["length_rope_types", "stateless_length_ropes"]

_PROBE = 4
"""A length ``_PROBE`` times the original maximum checks the attention scaling is constant."""


def length_rope_types(module: torch.nn.Module) -> dict[str | None, str]:
    """``{layer_type: rope_type}`` of ``module``'s length-dependent ropes (``dynamic`` or
    ``longrope``; layer type None for a module with one rope), ``{}`` for anything else."""
    if _update_wrapper(type(module).forward) is None:
        return {}
    kinds = getattr(module, "rope_type", None)
    table = kinds if isinstance(kinds, dict) else {None: kinds}
    return {k: v for k, v in table.items()
            if isinstance(v, str) and ("dynamic" in v or v == "longrope")}


def stateless_length_ropes(traced: torch.nn.Module) -> tuple[str, ...]:
    """Give every dynamic-NTK rope of ``traced`` (the shadow tree, never the user's model)
    its stateless forward; returns their module paths."""
    done = []
    for path, module in traced.named_modules():
        dynamic = {k: v for k, v in length_rope_types(module).items() if "dynamic" in v}
        if not dynamic:
            continue
        inner = _update_wrapper(type(module).forward).__wrapped__  # type: ignore[union-attr]
        for layer_type in dynamic:
            _check_scaling(path, module, layer_type)
        module.forward = types.MethodType(_stateless(inner, set(dynamic)), module)
        done.append(path)
    return tuple(done)


def _stateless(inner: Any, dynamic: set[str | None]) -> Any:
    def forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> Any:
        if layer_type not in dynamic:
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            return inner(self, x, position_ids, **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        original = getattr(self, f"{prefix}original_inv_freq").to(x.device)
        seq_len = torch.max(position_ids) + 1
        scaled, _ = _init_fn(self, layer_type)(self.config, x.device, seq_len=seq_len,
                                               layer_type=layer_type)
        inv_freq = torch.where(seq_len > self.original_max_seq_len,
                               scaled.to(original.dtype), original)
        view = _View(self, {f"{prefix}inv_freq": inv_freq})
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        return inner(view, x, position_ids, **kwargs)
    return forward


class _View:
    """``module`` with some attributes replaced (the frequencies of this call); everything
    else is read from the module itself."""

    def __init__(self, module: torch.nn.Module, values: dict[str, Any]) -> None:
        self.__dict__.update(values, _module=module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def _init_fn(module: torch.nn.Module, layer_type: str | None) -> Any:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = module.rope_type if layer_type is None else module.rope_type[layer_type]
    return ROPE_INIT_FUNCTIONS[kind]


def _check_scaling(path: str, module: torch.nn.Module, layer_type: str | None) -> None:
    """Refuse a rope whose attention scaling changes with the length (a Python float the
    capture would keep at the example's value)."""
    length = _PROBE * int(module.original_max_seq_len)
    _, scaling = _init_fn(module, layer_type)(module.config, None, seq_len=length,
                                              layer_type=layer_type)
    prefix = "" if layer_type is None else f"{layer_type}_"
    kept = getattr(module, f"{prefix}attention_scaling", getattr(module, "attention_scaling", 1.0))
    if float(scaling) != float(kept):
        raise CaptureError(
            f"the dynamic rope {path or type(module).__name__} scales attention by "
            f"{kept} and by {scaling} at {length} positions: a scale that "
            "depends on the length is a Python number torch.export keeps constant. fix: load "
            "the model without the scaling (rope_scaling=None), exact up to "
            f"max_position_embeddings={module.original_max_seq_len}")


def _update_wrapper(forward: Any) -> Any:
    """The ``dynamic_rope_update`` wrapper in ``forward``'s chain of ``__wrapped__``, or None."""
    fn, seen = forward, 0
    while fn is not None and seen < 8:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_qualname == "dynamic_rope_update.<locals>.wrapper":
            return fn
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None
