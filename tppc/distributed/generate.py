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

from tppc.errors import RuntimeInputError
from tppc.generation import DEFAULT, check_max_new_tokens, greedy_decode, stop_tokens
from tppc.pipeline.block_generate import BlockCall, block_steps, block_units
from tppc.pipeline.cache_resets import cache_reset_length
from tppc.pipeline.generate import (
    TORCH_OPS,
    Generating,
    grown_input,
    logits_output,
    prefix_inputs,
    token_input_index,
)
from tppc.program.state import Call, next_epoch

__all__ = ["GeneratingRank", "distributed_generate", "refuse_cache_reset"]


class GeneratingRank(Generating, Protocol):
    """What :func:`distributed_generate` needs of a rank (a ``DistributedPipeline``)."""

    @property
    def rank(self) -> int: ...
    @property
    def results(self) -> str: ...

    def share_generate(self, input_ids: Any, max_new_tokens: int) -> tuple[Any, int]: ...

    def share_inputs(self, what: str, value: Any, check: Any = None) -> Any: ...

    def broadcast_token(self, token: torch.Tensor | None, like: torch.Tensor,
                        src: int | None = None) -> torch.Tensor: ...


def distributed_generate(cp: GeneratingRank, input_ids: torch.Tensor | None,
                         max_new_tokens: int = 20, *,
                         eos_token_id: int | Sequence[int] | Any | None = DEFAULT,
                         pad_token_id: int | Any | None = DEFAULT) -> torch.Tensor | None:
    """Prompt + up to ``max_new_tokens`` greedy tokens; on rank 0 (or every rank with
    ``results="all"``), None elsewhere. Rank 0's ``input_ids`` are used."""
    block = cp.context.block_size
    if block is not None:  # prompt grown to whole blocks before rank 0 binds it
        return _block_generate(cp, block, input_ids, max_new_tokens, eos_token_id,
                               pad_token_id)
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
    per_step = bool(program.signature.length_tables)
    refuse_cache_reset(cp, prompt, total, per_step)
    state = cp.states.acquire(front, total)
    epoch = next_epoch()

    def step(n: int) -> torch.Tensor | None:
        """This rank's share of the prefill (``n == prompt``) or of one decoding step; the
        logits on the leader, None elsewhere (tables of the whole length at each step's
        length, as :func:`tppc.pipeline.generate.greedy_generate` evaluates them)."""
        chunks = program.chunks if n == prompt else ((n - 1, n),)
        length = n if per_step else total
        inputs = tuple(prefix_inputs(front, flat, n)) if per_step else tuple(flat)
        last: dict[str, Any] = {}
        cp.execute(program, Call(inputs, chunks, length, length, epoch), state,
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


def refuse_cache_reset(cp: GeneratingRank, prompt: int, total: int, per_step: bool) -> None:
    """Refuse a generation that passes the length where transformers recomputes the whole
    sequence without its cache (:mod:`tppc.pipeline.cache_resets`; one process does it)."""
    reset = cache_reset_length(cp.model) if per_step else None
    if reset is not None and prompt < reset < total:
        raise RuntimeInputError(
            f"{cp.model_name} generating from {prompt} to {total} tokens passes {reset} "
            f"tokens, where transformers' generate recomputes the whole sequence with its "
            "long rope factors (dropping its cache); a job does not re-plan that prefill. "
            f"fix: generate up to {reset} tokens (max_new_tokens={reset - prompt}), then "
            "again from that output: its prefill is the one transformers computes")


def _block_generate(cp: GeneratingRank, block: int, input_ids: torch.Tensor | None,
                    max_new_tokens: int, eos_token_id: Any, pad_token_id: Any
                    ) -> torch.Tensor | None:
    """:func:`distributed_generate` of a block capture (:mod:`tppc.pipeline.block_generate`):
    rank 0's prompt grown to whole blocks (the last token repeated) is shared; every rank
    steps the current block and puts back the carried states of its own worker."""
    value: tuple[Any, Any, int] = (input_ids, max_new_tokens, 0)
    if cp.rank == 0 and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
            and input_ids.shape[1] >= 1 and isinstance(max_new_tokens, int) \
            and not isinstance(max_new_tokens, bool) and max_new_tokens >= 1:
        prompt = int(input_ids.shape[1])
        width = block_units(prompt, max_new_tokens, block)[1]
        value = (grown_input("input_ids", input_ids, prompt, width), max_new_tokens, prompt)

    def check(shared: tuple[Any, Any, int]) -> None:
        """On rank 0: its error on every rank."""
        check_max_new_tokens(shared[1])
        if shared[2] < 1:
            raise RuntimeInputError(f"generate: input_ids must be a (batch, prompt) tensor of "
                                    f"at least one token, got {shared[0]!r:.80}. fix: pass "
                                    "the tokenized prompt")
        cp.bind((shared[0],), {})

    input_ids, max_new_tokens, prompt = cp.share_inputs("generate", value, check)
    eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=cp.eos_token_id,
                               model_pad=cp.pad_token_id)
    units, _ = block_units(prompt, max_new_tokens, block)
    front, bound = cp.bind((input_ids,), {})
    program = cp.program(max(prompt // block, 2), front)
    flat = tuple(bound.flat)
    ids = flat[token_input_index(cp.model_name, front)]
    state = cp.states.acquire(front, units)
    gen = BlockCall(program, state, flat, front, prompt, units, block)
    step = block_steps(cp, gen, (program.runners[cp.rank],), None)

    def share(token: torch.Tensor | None) -> torch.Tensor:
        return cp.broadcast_token(None if token is None else token.to(ids.dtype), ids[:, 0],
                                  program.leader)

    length = greedy_decode(ids[:, :prompt + max_new_tokens], prompt, step, TORCH_OPS,
                           eos_ids=eos_ids, pad=pad, share=share)
    cp.states.finish(front, state, length - 1)  # tokens of exact K/V (as block_generate)
    if cp.results == "rank0" and cp.rank != 0:
        return None
    return ids[:, :length].clone()
