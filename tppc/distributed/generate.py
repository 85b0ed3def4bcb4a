"""Greedy generation through a multi-process pipeline (every rank steps the same loop).

The prefill runs the prompt's chunks through the ranks; each decoding step is a one-token
chunk through every rank in order (the shards of a tensor-parallel stage together, each on
its K/V heads). Only the leader (the last stage's rank, or its first shard) has the logits:
it picks the token (:func:`tppc.generation.greedy_decode`, HF's ``generate(do_sample=False)``
rule) and broadcasts it, so every rank appends the same token, ends the same sequences and
stops at the same step.

Before anything grows to the generation's length, every rank prices its own share (its
worker's K/V and state buffers, the grown inputs: :func:`tppc.calls.kv_memory.generation_need`)
against its device's free memory, and the ranks exchange them (:func:`check_rank_memory`): the
CPU ranks of one host share its RAM, the ranks on one GPU share it, so each such pool is
charged the sum of its ranks' needs, and every rank refuses the same generation with the same
message (:func:`tppc.calls.kv_memory.refuse_unfitting`, the rule of ``cp.generate``).
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tppc.calls import kv_memory
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

__all__ = ["GeneratingRank", "check_rank_memory", "distributed_generate", "refuse_cache_reset"]


class GeneratingRank(Generating, Protocol):
    """What :func:`distributed_generate` needs of a rank (a ``DistributedPipeline``)."""

    @property
    def rank(self) -> int: ...
    @property
    def results(self) -> str: ...
    @property
    def device(self) -> torch.device: ...

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]: ...

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
    check_rank_memory(cp, program, front, bound.flat, prompt, max_new_tokens)  # before ids
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
    rank 0's prompt grown to its whole blocks (the last token repeated) is shared; every rank
    checks the memory (:func:`check_rank_memory`), grows it to the generation's blocks, steps
    the current block and puts back the carried states of its own worker."""
    value: tuple[Any, Any, int] = (input_ids, max_new_tokens, 0)
    if cp.rank == 0 and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
            and input_ids.shape[1] >= 1:
        prompt = int(input_ids.shape[1])
        width = block_units(prompt, 0, block)[1]  # the prompt's blocks: nothing grows yet
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
    units, width = block_units(prompt, max_new_tokens, block)
    front, bound = cp.bind((input_ids,), {})
    check_rank_memory(cp, cp.program(max(prompt // block, 2), front), front, bound.flat,
                      prompt, max_new_tokens, block=block, units=units)
    grown = grown_input("input_ids", input_ids[:, :prompt], prompt, width)
    front, bound = cp.bind((grown,), {})
    program = cp.program(max(prompt // block, 2), front)  # cached: the same capture
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


def check_rank_memory(cp: GeneratingRank, program: Any, front: Any, flat: Sequence[Any],
                      prompt: int, max_new_tokens: int, *, block: int = 1,
                      units: int | None = None) -> None:
    """Refuse, on every rank alike, a generation that some memory pool of the job cannot
    hold (module docstring; collective: every rank calls it).

    Each rank sends ``[host, GPU index or -1, need and free bytes there, need and free bytes
    of the host]``: its worker's buffers at ``units`` units of ``block`` tokens on its device
    (the other workers' stages are on the meta device here), the inputs of ``flat`` grown to
    that length where they live; a pool's need is the sum over its ranks, its free memory
    the least any of them saw (-1: unknown, not checked).

    Raises:
        RuntimeInputError: naming the tokens, the pool (``cpu of ranks 0, 1``), the need,
            the free memory and the largest ``max_new_tokens`` that fits.
    """
    units = -(-(prompt + max_new_tokens) // block) if units is None else units
    need = kv_memory.generation_need(program, front, flat, units, block)
    gpu = cp.device if cp.device.type == "cuda" else None
    host_need = sum(n for d, n in need.items() if d.type == "cpu")
    host_free = kv_memory.host_free_bytes()
    gpu_free = kv_memory.free_bytes(gpu) if gpu is not None else None
    mine = (zlib.crc32(socket.gethostname().encode()), -1 if gpu is None else gpu.index or 0,
            need.get(gpu, 0) if gpu is not None else 0, -1 if gpu_free is None else gpu_free,
            host_need, -1 if host_free is None else host_free)
    needs, rooms = _pooled(cp.gather_ints(mine))
    kv_memory.refuse_unfitting(needs, rooms.get, prompt, max_new_tokens, block=block, units=units)


def _pooled(rows: Sequence[Sequence[int]]) -> tuple[dict[str, int], dict[str, int | None]]:
    """``(need, free)`` per pool, named ``"cpu of ranks 0, 1"`` or ``"cuda:0 of rank 1"``,
    from every rank's row of :func:`check_rank_memory` (free: the least known, or None)."""
    members: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for rank, (host, index, on_gpu, gpu_room, on_host, host_room) in enumerate(rows):
        members.setdefault((host, -1), []).append((rank, on_host, host_room))
        if index >= 0:
            members.setdefault((host, index), []).append((rank, on_gpu, gpu_room))
    needs: dict[str, int] = {}
    rooms: dict[str, int | None] = {}
    for (_, index), shares in members.items():
        ranks = [rank for rank, _, _ in shares]
        label = (f"{'cpu' if index < 0 else f'cuda:{index}'} of "
                 f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
        known = [room for _, _, room in shares if room >= 0]
        needs[label] = sum(nbytes for _, nbytes, _ in shares)
        rooms[label] = min(known) if known else None
    return needs, rooms
