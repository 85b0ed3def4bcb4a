"""Greedy generation through a multi-process pipeline (every rank steps the same loop).

The prefill runs the prompt's chunks through the ranks; each decoding step is a one-token
chunk through every rank in order (the shards of a tensor-parallel stage together, each on
its K/V heads). Only the leader (the last stage's rank, or its first shard) has the logits:
it picks the token (:func:`tppc.generation.greedy_decode`, HF's ``generate(do_sample=False)``
rule) and broadcasts it, so every rank appends the same token, ends the same sequences and
stops at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tppc.frontend.block_capture import refuse_block_decode
from tppc.generation import DEFAULT, greedy_decode, stop_tokens
from tppc.pipeline.generate import TORCH_OPS, Generating, logits_output, token_input_index
from tppc.program.state import Call, next_epoch

__all__ = ["GeneratingRank", "distributed_generate"]


class GeneratingRank(Generating, Protocol):
    """What :func:`distributed_generate` needs of a rank (a ``DistributedPipeline``)."""

    @property
    def rank(self) -> int: ...
    @property
    def results(self) -> str: ...

    def share_generate(self, input_ids: Any, max_new_tokens: int) -> tuple[Any, int]: ...

    def broadcast_token(self, token: torch.Tensor | None, like: torch.Tensor,
                        src: int | None = None) -> torch.Tensor: ...


def distributed_generate(cp: GeneratingRank, input_ids: torch.Tensor | None,
                         max_new_tokens: int = 20, *,
                         eos_token_id: int | Sequence[int] | Any | None = DEFAULT,
                         pad_token_id: int | Any | None = DEFAULT) -> torch.Tensor | None:
    """Prompt + up to ``max_new_tokens`` greedy tokens; on rank 0 (or every rank with
    ``results="all"``), None elsewhere. Rank 0's ``input_ids`` are used."""
    refuse_block_decode(cp.context.block_size, cp.model_name)  # on every rank, before all
    input_ids, max_new_tokens = cp.share_generate(input_ids, max_new_tokens)
    eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=cp.eos_token_id,
                               model_pad=cp.pad_token_id)
    front, bound = cp.bind((input_ids,), {})
    prompt = bound.length
    total = prompt + max_new_tokens
    program = cp.program(prompt, front)
    logits_at = logits_output(cp.model_name, front)
    ids = torch.zeros(input_ids.shape[0], total, dtype=input_ids.dtype)
    ids[:, :prompt] = input_ids
    flat = list(bound.flat)
    flat[token_input_index(cp.model_name, front)] = ids
    state = cp.states.acquire(front, total)
    epoch = next_epoch()

    def step(n: int) -> torch.Tensor | None:
        """This rank's share of the prefill (``n == prompt``) or of one decoding step; the
        logits on the leader, None elsewhere."""
        chunks = program.chunks if n == prompt else ((n - 1, n),)
        last: dict[str, Any] = {}
        cp.execute(program, Call(tuple(flat), chunks, total, total, epoch), state,
                   sink=lambda i, values: last.update(values=values))
        return last["values"][logits_at] if "values" in last else None

    def share(token: torch.Tensor | None) -> torch.Tensor:
        return cp.broadcast_token(None if token is None else token.to(ids.dtype), ids[:, 0],
                                  program.leader)

    length = greedy_decode(ids, prompt, step, TORCH_OPS, eos_ids=eos_ids, pad=pad,
                           share=share)
    cp.states.finish(front, state, length - 1)
    if cp.results == "rank0" and cp.rank != 0:
        return None
    return ids[:, :length].clone()
