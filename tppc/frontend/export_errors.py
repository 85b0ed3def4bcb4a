"""Why torch.export could not capture a model, in words: the construct, where, and the fix.

:func:`explain` turns an export failure into a :class:`~tppc.errors.CaptureError` message:
the first of ``_HINTS`` whose pattern matches the error names the construct (dynamic-NTK
rope, data-dependent control flow, an unsupported op, a pinned length, a ``.data`` write, an
unknown pytree type, a K/V cache object) and its fix; the user's frame, the module of a
lifted tensor or the unknown type says where. :func:`size_ints_reason` adds why a length
pinned by Python-int size inputs could not be deferred.
"""

from __future__ import annotations

import inspect
import re
import traceback
from typing import Any

import torch

__all__ = ["explain", "size_ints_reason"]


_DATA_DEPENDENT = r"GuardOnDataDependentSymNode|data-dependent|Could not guard on data-dependent"
_CACHE = r"cache|past_key_values|DynamicCache"
_HINTS: list[tuple[str, str, str]] = [
    (r"max_seq_len_cached|dynamic_frequency_update",
     "a rotary embedding whose frequencies depend on the longest position seen (dynamic "
     "NTK scaling written as a Python branch on tensor values; transformers' own "
     "dynamic_rope_update ropes are captured per call length, this one is written "
     "differently)",
     "compute the frequencies with tensor ops of max(position_ids) + 1 (torch.where(seq_len "
     "> original, scaled, original), as tppc/frontend/length_ropes.py does for "
     "transformers' ropes); or, for sequences up to max_position_embeddings, load the "
     "model without the scaling (rope_scaling=None): identical results there"),
    (rf"(?s)(?:{_DATA_DEPENDENT}).*\bin unbind\)",
     "a Python loop over the rows of a tensor of data-dependent length (an eager mixture "
     "of experts looping over the experts the routing hit, `for expert_idx in expert_hit`: "
     "how many times it runs depends on the token values)",
     "loop over a fixed count instead: every expert, `for expert_idx in range(num_experts)` "
     "(an expert no token picked adds nothing; the rows each expert takes, "
     "`torch.where(expert_mask[expert_idx])`, may stay data-dependent: tppc captures them "
     "and prices each at its bound), or, where the model's config accepts it, "
     "experts_implementation=\"grouped_mm\""),
    (_DATA_DEPENDENT,
     "data-dependent control flow (a Python branch or size that depends on tensor values)",
     "replace the branch with torch.where / torch.cond, or move it out of forward"),
    (r"Unsupported|not supported|NotImplementedError|No registered",
     "an operation torch.export does not support",
     "rewrite that operation with standard torch ops, or capture a submodule without it"),
    (r"Constraints violated|specializ",
     "the sequence length was fixed to its example value by the model code",
     "avoid int()/math on sizes, or pass seq_dims= with the right axes"),
    (r"fake tensor in the exported program constant",
     "a tensor made inside forward and written through `.data` (an alias torch.export does "
     "not trace, so the tensor stays a fake constant; diffusers' CogVideoX patch embedding "
     "builds its positional table so at a size other than its config's sample size)",
     "write the tensor without `.data` (torch.cat, index_put), or build the model with its "
     "size config equal to this input's size (a sincos table is not a weight: "
     "from_pretrained(..., sample_height=h, sample_width=w) loads the same weights)"),
    (r"in (?:output|input), which is not a known type",
     "an input or output of a type torch.export cannot flatten (a class that is neither a "
     "tensor, a tuple, a list, a dict nor a dataclass; dataclasses are registered by tppc)",
     "return tensors in a tuple, a dict or a dataclass, or register the class with "
     "torch.utils._pytree.register_pytree_node"),
    (_CACHE,
     "a key/value cache object in the inputs or outputs",
     "do not pass past_key_values; tppc builds its own K/V buffers"),
]


def _hint(exc: Exception, where: str = "") -> tuple[str, str, str] | None:
    """The first entry of ``_HINTS`` whose pattern matches the error (or the user frame
    it names), or None."""
    text = f"{type(exc).__name__}: {exc}{where}"
    return next((h for h in _HINTS if re.search(h[0], text, flags=re.IGNORECASE)), None)


def size_ints_reason(bound: inspect.BoundArguments) -> str:
    """Why a pinned length could not be deferred when inputs carry sizes as Python ints
    (QwenImage's ``img_shapes=[(1, 4, 4)]``, LTX's ``num_frames=2, height=4, width=4``),
    else ``""``."""
    def ints(v: Any) -> bool:
        if isinstance(v, list | tuple):
            return bool(v) and all(ints(x) for x in v)
        return isinstance(v, int) and not isinstance(v, bool)

    names = [f"{k}={v!r}" for k, v in bound.arguments.items() if ints(v)]
    if not names:
        return ""
    return (f"; the model reads sizes from the integer input {', '.join(names)}: torch.export "
            "keeps Python ints constant, so a table built from them (a rotary table as long as "
            "the image) has the example's length, and its use with the tokens equates the "
            "sequence length to it. tppc takes the sequence length from tensor axes only: "
            "where the model also takes the positions as a tensor (LTX: video_coords of shape "
            "(batch, 3, tokens)), pass that instead")


def explain(model: torch.nn.Module, exc: Exception, why: str = "") -> str:
    text = f"{type(exc).__name__}: {exc}"
    where = _user_frame(exc)
    hint = _hint(exc, where)
    if hint is not None:
        _pattern, what, fix = hint
        what += why
        where = where or _lifted_owner(text) or _unknown_type(text)
        return (f"torch.export could not capture {type(model).__name__}: {what}{where}.\n"
                f"fix: {fix}.\ntorch.export's error, in full:\n{text.strip()}")
    return (f"torch.export could not capture {type(model).__name__}{where}.\n"
            "fix: make the failing construct exportable (see torch.export's error below), or "
            f"capture a submodule without it.\ntorch.export's error, in full:\n{text.strip()}")


def _lifted_owner(text: str) -> str:
    """`` in module X`` for torch.export's "model attribute: X.lifted_tensor_0", else ''."""
    found = re.search(r"model attribute: (\S+)\.lifted_tensor", text)
    return f" in module {found.group(1)}" if found else ""


def _unknown_type(text: str) -> str:
    """``: <class>`` for torch.export's "Found <class 'X'> in output, which is not a known
    type", else ''."""
    found = re.search(r"Found <class '([^']+)'> in (?:output|input)", text)
    return f": {found.group(1)}" if found else ""


def _user_frame(exc: Exception) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/tppc/" not in frame.filename \
                and not frame.filename.startswith("<"):  # generated code: <string>, <eval...>
            return f" at {frame.filename}:{frame.lineno} ({frame.line})"
    return ""
