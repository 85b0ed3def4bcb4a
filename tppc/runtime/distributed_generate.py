"""Greedy generation through a multi-process pipeline (every rank steps the same loop).

The prefill runs the prompt's chunks through the ranks; each decoding step is a one-token
chunk through every rank in order. Only the last rank has the logits: it picks the token
(argmax of the last position, HF's ``generate(do_sample=False)`` rule) and broadcasts it, so
every rank appends the same token, ends the same sequences and stops at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tppc.generation import DEFAULT, stop_tokens
from tppc.program.state import Call, next_epoch
from tppc.runtime.generate import logits_output, token_input_index

__all__ = ["distributed_generate"]



def distributed_generate(cp: Any, input_ids: torch.Tensor | None,
                         max_new_tokens: int = 20, *,
                         eos_token_id: int | Sequence[int] | Any | None = DEFAULT,
                         pad_token_id: int | Any | None = DEFAULT) -> torch.Tensor | None:
    """Prompt + up to ``max_new_tokens`` greedy tokens; on rank 0 (or every rank with
    ``results="all"``), None elsewhere. Rank 0's ``input_ids`` are used."""
    input_ids, max_new_tokens = cp.share_generate(input_ids, max_new_tokens)
    eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=cp.eos_token_id,
                               model_pad=cp.pad_token_id)
    front, bound = cp.bind((input_ids,), {})
    prompt = bound.length
    total = prompt + max_new_tokens
    program = cp.program(prompt, front)
    index = token_input_index(cp, front)
    logits_at = logits_output(cp, front)
    flat = list(bound.flat)
    ids = torch.zeros(input_ids.shape[0], total, dtype=input_ids.dtype)
    ids[:, :prompt] = input_ids
    flat[index] = ids
    state = front.pool.acquire(total)
    epoch = next_epoch()
    last: dict[str, Any] = {}
    sink = last.__setitem__
    cp.execute(program, Call(tuple(flat), program.chunks, total, total, epoch), state,
               sink=lambda i, values: sink("values", values))
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    length = prompt
    while True:
        token = None
        if "values" in last:  # the last rank
            token = last.pop("values")[logits_at].select(1, -1).float().argmax(dim=-1)
            token = token.to(ids.dtype).cpu()
        token = cp.broadcast_token(token, ids[:, 0])
        if pad is not None:
            token = torch.where(unfinished, token, torch.full_like(token, pad))
        ids[:, length] = token
        length += 1
        if eos_ids:
            unfinished &= ~torch.isin(token, torch.tensor(eos_ids))
        if length == total or not bool(unfinished.any()):
            break
        step = Call(tuple(flat), ((length - 1, length),), total, total, epoch)
        cp.execute(program, step, state, sink=lambda i, values: sink("values", values))
    cp.finish(front, state, length - 1)
    if cp.results == "rank0" and cp.rank != 0:
        return None
    return ids[:, :length].clone()
