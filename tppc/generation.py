"""Rules every greedy ``generate`` shares (torch, ONNX Runtime, distributed): one place.

Imports neither torch nor numpy, so the torch-free loaded runner (``tppc.load``) uses it too.

Terms:
    stop tokens: the end-of-sequence ids that end a row, and the pad id appended to ended
        rows (HF ``generate(do_sample=False)``'s rule: the model's ``generation_config`` by
        default, the first EOS id when there is no pad id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tppc.errors import RuntimeInputError

__all__ = ["DEFAULT", "check_max_new_tokens", "stop_tokens"]

DEFAULT: Any = object()
"""Sentinel of ``eos_token_id`` / ``pad_token_id``: take the model's."""


def check_max_new_tokens(max_new_tokens: Any) -> None:
    """Refuse anything but an int ≥ 1 (before anything runs).

    Raises:
        RuntimeInputError: naming the value.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise RuntimeInputError(f"max_new_tokens={max_new_tokens!r} must be an integer ≥ 1")


def stop_tokens(eos_token_id: int | Sequence[int] | Any | None,
                pad_token_id: int | Any | None, *, model_eos: Any, model_pad: Any
                ) -> tuple[list[int], Any]:
    """``(eos ids, pad id)``: the given ids, or the model's where :data:`DEFAULT` was given."""
    eos = model_eos if eos_token_id is DEFAULT else eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = model_pad if pad_token_id is DEFAULT else pad_token_id
    return eos_ids, eos_ids[0] if pad is None and eos_ids else pad
