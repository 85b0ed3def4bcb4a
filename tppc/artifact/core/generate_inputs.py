"""What a loaded artifact's ``generate`` holds: its token ids grown, and whether they fit.

Terms:
    units: what the buffers of a generation hold: ``prompt + max_new_tokens`` tokens, or for a
        block scan (an input's ``seq_rows`` k > 1) the whole blocks of them, 2 at least
        (:func:`tppc.calls.kv_memory.held_units`).
    need: the bytes of this process's stages' buffers at that length
        (:meth:`tppc.backends.onnxruntime.OrtStage.buffer_bytes`: numpy arrays in host
        memory, whatever the execution provider) plus the token ids grown to it.

:func:`check_memory` refuses a need above the host's free memory before anything grows or
is allocated, with the rule and message of every ``generate``
(:func:`tppc.calls.kv_memory.refuse_unfitting`): ``max_new_tokens=10**11`` is refused at
once, naming the blocks and the largest ``max_new_tokens`` that fits, instead of a
``MemoryError`` (or the machine's swap) in the ids' growth. Imports neither torch nor onnx.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tppc.calls import kv_memory
from tppc.errors import RuntimeInputError

__all__ = ["check_memory", "grown_ids"]


def check_memory(stages: Sequence[Any], input_ids: Any, max_new_tokens: int,
                 block: int) -> None:
    """Refuse a generation from ``input_ids`` whose need on ``stages`` exceeds the host's
    free memory (module docstring); ids of another shape are left to the binding's refusal.

    Raises:
        RuntimeInputError: naming the tokens, the blocks, the need, the free memory, the fix.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        return
    prompt = int(ids.shape[1])
    units = kv_memory.held_units(prompt, max_new_tokens, block)
    need = sum(stage.buffer_bytes(units) for stage in stages) \
        + ids.nbytes // prompt * units * block
    kv_memory.refuse_unfitting({"cpu": need}, lambda _: kv_memory.host_free_bytes(),
                               prompt, max_new_tokens, block=block, units=units)


def grown_ids(input_ids: Any, max_new_tokens: int, block: int) -> np.ndarray:
    """A block scan's prompt grown to the whole blocks of prompt + ``max_new_tokens`` (2 at
    least), the last token repeated (filler that the decode steps overwrite)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise RuntimeInputError(f"input_ids has shape {ids.shape}; generate takes (batch, "
                                "prompt) token ids of at least one token. fix: pass the "
                                "tokenized prompt")
    width = kv_memory.held_units(ids.shape[1], max_new_tokens, block) * block
    return np.concatenate([ids, np.repeat(ids[:, -1:], width - ids.shape[1], axis=1)], 1)
