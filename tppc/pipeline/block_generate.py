"""Greedy generation through a pipeline of a block-scan capture (``k`` × blocks).

Terms:
    block capture: a model that pads its sequence to whole blocks of ``k`` rows (Mamba2's
        chunked SSD scan), captured with the length ``k`` × blocks
        (:mod:`tppc.frontend.block_capture`): its graph runs whole blocks only, a plan's unit
        is one block, and its recurrences carry state buffers from block to block.
    current block: the block ``[b, b + k)``, ``b = k·⌊p/k⌋``, of the position ``p`` a decode
        step predicts from.
    filler: the rows ``p + 1 .. b + k − 1`` of the current block, which hold no token yet; the
        step fills them with the last real token (any finite values do: see below).
    block step: one decode step, the current block through every stage in order as one chunk
        of one unit; the logits are its row ``p``.

Why it is exact: the model is causal, so row ``p``'s output reads rows ``≤ p`` only, never
the filler. Every carried state (a block scan's state between blocks, a causal convolution's
last rows, a scan's last row) must stay the state at the block start ``b`` while the block is
incomplete: the step reads it, and its write (the state after the whole block, filler
included) is undone, by a copy of every state buffer taken before the step and put back after
it. The step at ``p = b + k − 1`` completes the block and keeps its states. K/V buffers are
written by position: a step rewrites rows ``b .. p`` with the same values, writes filler K/V
at rows ``> p`` that later steps overwrite with the true ones, and causal attention at row
``p`` reads keys ``≤ p`` only (no fill counter: a chunk's keys end at its last row).

The prefill runs the prompt's whole blocks pipelined (as any call), then its tail, if any, as
the first block step. A decode step therefore costs one block, ``k`` rows, on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tppc.calls.kv_memory import check_generation_memory, held_units
from tppc.errors import RuntimeInputError
from tppc.generation import DEFAULT, check_max_new_tokens, greedy_decode, stop_tokens
from tppc.pipeline.generate import (
    TORCH_OPS,
    Generating,
    grown_input,
    logits_output,
    mask_inputs,
    token_input_index,
)
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, CallState, next_epoch

if TYPE_CHECKING:
    from tppc.driver.options import ExecutorName
    from tppc.frontend.front_end import FrontEnd

__all__ = ["BlockCall", "block_generate", "block_steps", "block_units", "carried_states",
           "refuse_length_tables"]


def block_generate(cp: Generating, block: int, input_ids: torch.Tensor,
                   max_new_tokens: int = 20, *, attention_mask: torch.Tensor | None = None,
                   eos_token_id: int | Sequence[int] | Any | None = DEFAULT,
                   pad_token_id: int | Any | None = DEFAULT) -> torch.Tensor:
    """:func:`tppc.pipeline.generate.greedy_generate` for a block capture of ``block`` rows
    per block (module docstring): same arguments, same result; any prompt length ≥ 1.

    Raises:
        RuntimeInputError: bad inputs, before anything runs.
    """
    check_max_new_tokens(max_new_tokens)
    eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=cp.eos_token_id,
                               model_pad=cp.pad_token_id)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 1 \
            or input_ids.shape[-1] < 1:
        raise RuntimeInputError(f"generate: input_ids must be a (batch, prompt) tensor of at "
                                f"least one token, got {_described(input_ids)}. fix: pass the "
                                "tokenized prompt")
    prompt = int(input_ids.shape[-1])
    total = prompt + max_new_tokens
    units, width = block_units(prompt, max_new_tokens, block)
    if cp.max_seq is not None and width > cp.max_seq:  # the buffers hold whole blocks
        raise RuntimeInputError(
            f"{prompt} prompt tokens + max_new_tokens={max_new_tokens} = {total} tokens, "
            f"held as {units} blocks of {block} = {width} tokens, max_seq={cp.max_seq}. fix: "
            f"lower max_new_tokens to {cp.max_seq // block * block - prompt} or compile "
            f"with max_seq={width}")
    kwargs = mask_inputs(cp, attention_mask)
    # bound at the prompt's blocks first: nothing grows to the generation's width unchecked
    front, bound = _bound(cp, input_ids, kwargs, block_units(prompt, 0, block)[1])
    check_generation_memory(cp.program(max(prompt // block, 2), front), front, bound.flat,
                            prompt, max_new_tokens, block=block, units=units)
    front, bound = _bound(cp, input_ids, kwargs, width)
    program = cp.program(max(prompt // block, 2), front)  # cached: the same capture
    flat = tuple(bound.flat)
    ids = flat[token_input_index(cp.model_name, front)]
    state = cp.states.acquire(front, units)
    step = block_steps(cp, BlockCall(program, state, flat, front, prompt, units, block),
                       program.runners, "local")
    length = greedy_decode(ids[:, :total], prompt, step, TORCH_OPS, eos_ids=eos_ids, pad=pad)
    cp.states.finish(front, state, length - 1)  # K/V rows by position: all but the last
    return ids[:, :length].clone()


def _bound(cp: Generating, input_ids: torch.Tensor, kwargs: dict[str, torch.Tensor],
           width: int) -> tuple[FrontEnd, Any]:
    """``cp.bind`` of the prompt and its mask inputs grown to ``width`` tokens
    (:func:`grown_input`: the token ids with the last token as filler)."""
    prompt = int(input_ids.shape[-1])
    grown = {name: grown_input(name, value, prompt, width) for name, value in kwargs.items()}
    return cp.bind((grown_input("input_ids", input_ids, prompt, width),), grown)


def block_units(prompt: int, max_new_tokens: int, block: int) -> tuple[int, int]:
    """``(blocks, tokens)`` a generation holds (:func:`tppc.calls.kv_memory.held_units`)."""
    units = held_units(prompt, max_new_tokens, block)
    return units, units * block


@dataclass(frozen=True)
class BlockCall:
    """What the steps of one block-scan generation share (:func:`block_steps`).

    Attributes:
        program: the program of the prompt's whole blocks (2 at least).
        state: the call state, holding ``units`` blocks.
        flat: the bound flat inputs, grown to ``units`` blocks (:func:`grown_input`).
        front: the capture.
        prompt: prompt tokens.
        units: blocks the sequence inputs hold.
        block: ``k``, tokens per block.
    """

    program: Program
    state: CallState
    flat: tuple[Any, ...]
    front: FrontEnd
    prompt: int
    units: int
    block: int


def block_steps(cp: Generating, gen: BlockCall, runners: Sequence[StageProgram],
                step_executor: ExecutorName | None) -> Callable[[int], Any]:
    """``step(n)`` of :func:`tppc.generation.greedy_decode` for a block capture (module
    docstring): the prompt's whole blocks pipelined, its tail and each decode step as the
    current block, whose carried states in ``runners`` (the workers whose buffers this
    process holds) are put back while it is incomplete. ``step_executor`` runs the steps
    (None: the compiled one). The logits, or None where this process has none (a rank)."""
    program, state, flat, block, units = gen.program, gen.state, gen.flat, gen.block, gen.units
    refuse_length_tables(cp.model_name, program.signature.length_tables)
    ids = flat[token_input_index(cp.model_name, gen.front)]
    logits_at = logits_output(cp.model_name, gen.front)
    axis = gen.front.signature.output_axes[logits_at]
    epoch = next_epoch()
    whole = gen.prompt // block

    def run(chunks: tuple[tuple[int, int], ...], executor: ExecutorName | None) -> Any:
        last: dict[str, Any] = {}
        cp.execute(program, Call(flat, chunks, units, units, epoch), state,
                   sink=lambda i, values: last.update(values=values), executor=executor)
        return last["values"][logits_at] if "values" in last else None

    def block_step(p: int) -> Any:
        """The current block of position ``p`` as one chunk; its logits at row ``p``."""
        b, row = divmod(p, block)
        ids[:, p + 1:(b + 1) * block] = ids[:, p:p + 1]  # filler: the last real token
        saved = [] if row == block - 1 else \
            [(t, t.clone()) for t in carried_states(runners, state)]
        logits = run(((b, b + 1),), step_executor)
        for tensor, copy in saved:  # an incomplete block: its states stay its start's
            tensor.copy_(copy)
        return None if logits is None else logits.narrow(axis, row, 1)

    def step(n: int) -> Any:
        if n > gen.prompt:
            return block_step(n - 1)
        logits = None
        if whole >= 2:  # the prompt's whole blocks, pipelined
            logits = run(program.chunks, None)
        elif whole == 1:
            logits = run(((0, 1),), step_executor)
        return logits if n % block == 0 else block_step(n - 1)

    return step


def refuse_length_tables(model_name: str, tables: Sequence[str]) -> None:
    """Refuse a block scan's generation whose positional values depend on the whole length
    (a dynamic-NTK or longrope rope: ``signature.length_tables``): its decode steps run
    whole blocks with filler rows, which would count in that length."""
    if tables:
        raise RuntimeInputError(
            f"{model_name} generates by whole blocks of a block scan, and its positional "
            f"values {list(tables)[:4]} depend on the whole length (a dynamic-NTK or "
            "longrope rope): the filler rows of a decode step's block would count in it. "
            "fix: for sequences up to max_position_embeddings load the model without the "
            "rope scaling (rope_scaling=None: identical there); calls (cp(ids)) are exact at "
            "any length")


def carried_states(runners: Sequence[StageProgram], state: CallState) -> list[torch.Tensor]:
    """Every carried-state buffer (``BufferSpec.kind == "state"``) of ``runners`` (workers of a
    program, and their parts) in ``state`` (allocated on first use), each once."""
    found: dict[int, torch.Tensor] = {}
    for worker in runners:
        for stage in worker.parts or (worker,):
            buffers = state.buffers(stage)
            for spec in stage.buffers:
                if spec.kind == "state":
                    found.setdefault(id(buffers[spec.name]), buffers[spec.name])
    return list(found.values())


def _described(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
        else type(value).__name__

