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
        frequencies = {k: _frequencies(module, k) for k in dynamic}
        module.forward = types.MethodType(_stateless(inner, frequencies), module)
        done.append(path)
    return tuple(done)


def _stateless(inner: Any, frequencies: dict[str | None, Any]) -> Any:
    def forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> Any:
        if layer_type not in frequencies:
            kwargs = {} if layer_type is None else {"layer_type": layer_type}
            return inner(self, x, position_ids, **kwargs)
        prefix = "" if layer_type is None else f"{layer_type}_"
        original = getattr(self, f"{prefix}original_inv_freq").to(x.device)
        seq_len = torch.max(position_ids) + 1
        scaled = frequencies[layer_type](seq_len, x.device)
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


def _frequencies(module: torch.nn.Module, layer_type: str | None) -> Any:
    """``fn(seq_len, device)``: the dynamic frequencies of a tensor length. transformers'
    ``_compute_dynamic_ntk_parameters`` written without the tensor it makes of
    ``max_position_embeddings`` (a constant the capture would lift, which a rank building
    the model on ``meta`` has no value for), used when it equals the module's own
    ``rope_init_fn`` bit for bit at two lengths; else that function itself."""
    own = _init_fn(module, layer_type)

    def by_the_module(seq_len: torch.Tensor, device: Any) -> torch.Tensor:
        return own(module.config, device, seq_len=seq_len, layer_type=layer_type)[0]

    def ntk(seq_len: torch.Tensor, device: Any) -> torch.Tensor:
        config = module.config
        if layer_type is not None:  # as transformers reads it (Gemma 4's per-layer configs)
            try:
                config = config.per_layer_config[layer_type]
            except (AttributeError, KeyError, TypeError, ValueError):
                pass
        params = config.rope_parameters if layer_type is None \
            else config.rope_parameters[layer_type]
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        factor, longest = params["factor"], config.max_position_embeddings
        seq_len = torch.clamp(seq_len, min=longest)
        base = params["rope_theta"] * ((factor * seq_len / longest) - (factor - 1)) \
            ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(
            device=device, dtype=torch.float) / dim))

    original = int(module.original_max_seq_len)
    try:
        lengths = [torch.tensor(n) for n in (original + 1, 3 * original + 5)]
        same = all(torch.equal(ntk(n, None), by_the_module(n, None)) for n in lengths)
    except Exception:  # another rope_init_fn: used as it is
        same = False
    return ntk if same else by_the_module


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
