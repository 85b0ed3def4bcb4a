"""Greedy generation, one copy for every ``generate`` (torch, ONNX Runtime, distributed): the
stop rules and THE decode loop.

Imports neither torch nor numpy: the caller hands the loop its array operations
(:class:`ArrayOps`), so the torch-free loaded runner (``tppc.load``) runs the same loop as
:class:`tppc.CompiledPipeline` and the ranks of a job.

Terms:
    stop tokens: the end-of-sequence ids that end a row, and the pad id appended to ended
        rows (HF ``generate(do_sample=False)``'s rule: the model's ``generation_config`` by
        default, the first EOS id when there is no pad id).
    step: ``step(n)`` runs the model on the first ``n`` ids and returns the logits of the
        positions it ran, ``(batch, positions, vocab)``. Its first call (``n`` = the prompt)
        is the prefill; each later call is a one-token chunk at position ``n - 1``. A rank of
        a job that does not hold the logits returns None.
    share: the hook of a job that gives every rank the same token (the last rank's pick,
        broadcast): ``share(token or None) -> token``.

Example (a "model" whose logits always favour token 3, which is also the EOS):
    >>> import numpy as np
    >>> ops = ArrayOps(pick=lambda logits, ids: logits[:, -1].argmax(-1),
    ...                isin=lambda t, eos: np.isin(t, eos),
    ...                where=lambda keep, t, pad: np.where(keep, t, pad),
    ...                trues=lambda ids: np.ones(ids.shape[0], dtype=bool))
    >>> ids = np.zeros((1, 6), dtype=np.int64)
    >>> logits = np.eye(5)[[[3]]]                      # (1, 1, 5): argmax 3
    >>> greedy_decode(ids, 2, lambda n: logits, ops, eos_ids=[3], pad=0), ids[0].tolist()
    (3, [0, 0, 3, 0, 0, 0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tppc.errors import RuntimeInputError

__all__ = ["DEFAULT", "ArrayOps", "check_max_new_tokens", "greedy_decode", "stop_tokens"]

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


@dataclass(frozen=True)
class ArrayOps:
    """The four array operations of :func:`greedy_decode`, on one array library.

    Everything else the loop does (``ids[:, n] = token``, ``&=``, ``~``, ``.any()``) reads
    the same on torch tensors and numpy arrays.

    Attributes:
        pick: ``pick(logits, ids)``: the argmax over the vocabulary at the last position,
            ``(batch,)``, where ``ids`` lives (the greedy rule).
        isin: ``isin(tokens, eos_ids)``: bool ``(batch,)``, whether each token ends its row.
        where: ``where(keep, tokens, pad)``: ``tokens`` where ``keep``, else ``pad``.
        trues: ``trues(ids)``: bool ``(batch,)``, all true, where ``ids`` lives.
    """

    pick: Callable[[Any, Any], Any]
    isin: Callable[[Any, list[int]], Any]
    where: Callable[[Any, Any, int], Any]
    trues: Callable[[Any], Any]


def greedy_decode(ids: Any, prompt: int, step: Callable[[int], Any], ops: ArrayOps, *,
                  eos_ids: Sequence[int], pad: int | None,
                  share: Callable[[Any], Any] | None = None) -> int:
    """THE greedy decode loop: fills ``ids[:, prompt:]``, returns how many ids it holds.

    Each round takes the logits of ``step(n)`` (module docstring), picks the argmax token,
    pads the rows that already ended, writes the token at position ``n`` and ends the rows
    that produced an end-of-sequence id. It stops when every row has ended or ``ids`` is full
    (HF's ``generate(do_sample=False)``).

    Args:
        ids: ``(batch, total)`` token ids, the prompt in the first ``prompt`` columns.
        prompt: prompt length (≥ 1, < total).
        step: the model, ``step(n) -> logits`` (None on a rank without them).
        ops: the array operations of ``ids``' library.
        eos_ids: end-of-sequence ids (empty: rows never end early).
        pad: id written to ended rows (None: keep writing the argmax).
        share: a job's token broadcast (None in one process).

    Returns:
        The number of filled positions: ``prompt`` + the new tokens.
    """
    total = ids.shape[1]
    eos = list(eos_ids)
    unfinished = ops.trues(ids)
    length = prompt
    while True:
        logits = step(length)
        token = None if logits is None else ops.pick(logits, ids)
        if share is not None:
            token = share(token)
        if pad is not None:
            token = ops.where(unfinished, token, pad)
        ids[:, length] = token
        length += 1
        if eos:
            unfinished &= ~ops.isin(token, eos)
        if length == total or not bool(unfinished.any()):
            return length
