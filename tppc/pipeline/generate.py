"""Greedy generation through a compiled pipeline: pipelined prefill, then decoding steps.

The prefill runs the prompt's chunks through the stages with the compiled executor and
fills every stage's K/V buffers. Each decoding step is a one-token chunk at position ``t``
that runs through the stages in order (one sequence cannot overlap with itself), reading
the buffers. The positional values (rope tables, masks) are evaluated once, at the final
length, and sliced per step, unless they depend on the whole length (a dynamic-NTK rope:
``signature.length_tables``): then the prefill is a call of the prompt's length and each
step a call of its own length, as a model with a K/V cache computes them (and where
transformers drops the cache, Phi-3's longrope at ``original_max_position_embeddings + 1``
tokens, a prefill of the whole sequence: :mod:`tppc.pipeline.cache_resets`); a padding
mask (``attention_mask``) reaches every step whole. The loop and its rule for ending are :func:`tppc.generation.greedy_decode` (HF's
``generate(do_sample=False)``); this module gives it the pipeline as a step function. A
block-scan capture (``k`` × blocks) decodes by whole blocks instead:
:mod:`tppc.pipeline.block_generate`.

Example:
    >>> cp.generate(input_ids, max_new_tokens=8).shape                  # doctest: +SKIP
    torch.Size([1, 24])
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tppc.calls.call import Calling
from tppc.calls.kv_memory import check_generation_memory
from tppc.errors import RuntimeInputError
from tppc.generation import DEFAULT, ArrayOps, check_max_new_tokens, greedy_decode, stop_tokens
from tppc.pipeline.cache_resets import cache_reset_length
from tppc.pipeline.captures import check_length_limit
from tppc.program.state import Call, next_epoch

if TYPE_CHECKING:
    from tppc.frontend.front_end import FrontEnd

__all__ = ["TORCH_OPS", "Generating", "greedy_generate", "grown_input", "logits_output",
           "mask_inputs", "prefix_inputs", "token_input_index"]

TORCH_OPS = ArrayOps(
    pick=lambda logits, ids: logits.select(1, -1).float().argmax(dim=-1).to(ids.device),
    isin=lambda tokens, eos: torch.isin(tokens, torch.tensor(eos, device=tokens.device)),
    where=lambda keep, tokens, pad: torch.where(keep, tokens, torch.full_like(tokens, pad)),
    trues=lambda ids: torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device))
"""The decode loop's array operations on torch tensors."""


class Generating(Calling, Protocol):
    """What :func:`greedy_generate` needs of a pipeline (a :class:`tppc.CompiledPipeline`):
    the call algorithm's methods (:class:`tppc.calls.call.Calling`) and these."""

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def model_name(self) -> str: ...
    @property
    def eos_token_id(self) -> Any: ...
    @property
    def pad_token_id(self) -> Any: ...
    @property
    def max_seq(self) -> int | None: ...


def greedy_generate(cp: Generating, input_ids: torch.Tensor, max_new_tokens: int = 20,
                    *, attention_mask: torch.Tensor | None = None,
                    eos_token_id: int | Sequence[int] | Any | None = DEFAULT,
                    pad_token_id: int | Any | None = DEFAULT) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens greedily; returns prompt + new tokens.

    Args:
        cp: a pipeline compiled from a causal LM whose first per-token output is the logits.
        input_ids: ``(batch, prompt)`` token ids.
        max_new_tokens: tokens to generate at most.
        attention_mask: ``(batch, prompt)``, 0 at padding (a batch of prompts of different
            lengths, left- or right-padded). As in HF, positions then count valid tokens only
            (``position_ids`` from its cumulative sum, when the model takes them) and every
            generated token is valid.
        eos_token_id: end-of-sequence id(s) (default: the model's ``generation_config``).
        pad_token_id: id appended to ended sequences (default: the model's, else the EOS).

    Raises:
        RuntimeInputError: bad inputs (see :meth:`CompiledPipeline.bind`), checked before
            anything runs; the pipeline is unchanged by a failed call.
    """
    check_max_new_tokens(max_new_tokens)
    eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=cp.eos_token_id,
                               model_pad=cp.pad_token_id)
    kwargs = mask_inputs(cp, attention_mask)
    front, bound = cp.bind((input_ids,), kwargs)
    prompt = bound.length
    total = prompt + max_new_tokens
    if cp.max_seq is not None and total > cp.max_seq:
        raise RuntimeInputError(
            f"{prompt} prompt tokens + max_new_tokens={max_new_tokens} = {total} tokens, "
            f"max_seq={cp.max_seq}. fix: lower max_new_tokens to {cp.max_seq - prompt} or "
            f"compile with max_seq={total}")
    check_length_limit(front.ctx, total, f"{prompt} prompt tokens + max_new_tokens="
                       f"{max_new_tokens}")
    check_generation_memory(cp.program(prompt, front), front, bound.flat, prompt,
                            max_new_tokens)  # before anything is allocated
    program = cp.program(prompt, front)
    flat = tuple(_extended(front, bound.flat, total))
    ids = flat[token_input_index(cp.model_name, front)]
    logits_at = logits_output(cp.model_name, front)
    state = cp.states.acquire(front, total)
    epoch = next_epoch()

    per_step = bool(program.signature.length_tables)
    reset = cache_reset_length(cp.model) if per_step else None

    running = [program]  # after a reset, its program's stages hold the K/V: decode on it

    def step(n: int) -> torch.Tensor:
        length = n if per_step else total
        inputs = tuple(prefix_inputs(front, flat, n)) if length < total else flat
        if n == prompt or n == reset:  # a prefill: the chunks of n tokens, pipelined
            last: dict[str, Any] = {}
            if n != prompt:  # transformers' reset: every position again
                running[0] = cp.program(n, front)
            run = running[0]
            cp.execute(run, Call(inputs, run.chunks, length, length, epoch), state,
                       sink=lambda i, values: last.update(values=values))
            return last["values"][logits_at]
        call = Call(inputs, ((n - 1, n),), length, length, epoch)
        return cp.execute(running[0], call, state, executor="local")[-1][logits_at]

    length = greedy_decode(ids, prompt, step, TORCH_OPS, eos_ids=eos_ids, pad=pad)
    cp.states.finish(front, state, length - 1)  # the last token's K/V are not computed
    return ids[:, :length].clone()


def mask_inputs(cp: Generating, attention_mask: torch.Tensor | None
                 ) -> dict[str, torch.Tensor]:
    """``attention_mask`` and HF's ``position_ids`` for it (when the model takes them)."""
    if attention_mask is None:
        return {}
    kwargs = {"attention_mask": attention_mask}
    forward = inspect.signature(cp.model.forward).parameters
    if "position_ids" in forward:
        positions = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = positions.masked_fill(attention_mask == 0, 0)
    return kwargs


def prefix_inputs(front: FrontEnd, flat: Sequence[Any], n: int) -> list[Any]:
    """The flat inputs with every sequence input cut to its first ``n`` positions (views):
    a step of a generation whose positional values depend on the length
    (``signature.length_tables``) runs as a call of ``n`` tokens."""
    out = list(flat)
    for i, name in enumerate(front.signature.user_inputs):
        axes = front.ctx.seq_inputs.get(name)
        if axes and isinstance(out[i], torch.Tensor):
            for axis in axes:
                out[i] = out[i].narrow(axis, 0, n)
    return out


def _extended(front: FrontEnd, flat: Sequence[Any], total: int) -> list[Any]:
    """The flat inputs with every sequence input grown to ``total`` positions
    (:func:`grown_input`; token ids as zeros, filled as they are generated)."""
    out = list(flat)
    for i, name in enumerate(front.signature.user_inputs):
        axes = front.ctx.seq_inputs.get(name)
        if axes and isinstance(out[i], torch.Tensor):
            out[i] = grown_input(name, out[i], out[i].shape[axes[0]], total, filler=False)
    return out


def grown_input(name: str, value: Any, prompt: int, width: int, *, filler: bool = True
                ) -> Any:
    """A sequence input grown from ``prompt`` to ``width`` positions on its last axis: an
    ``attention_mask`` is 1 (generated tokens are valid), ``position_ids`` count on from
    each row's last position, token ids repeat the last token with ``filler`` (block
    steps read them: :mod:`.block_generate`), else zeros (overwritten as tokens are
    generated). Anything else is returned as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[-1] != prompt:
        return value
    grown = value.new_zeros((*value.shape[:-1], width))
    grown[..., :prompt] = value
    if name == "attention_mask":
        grown[..., prompt:] = 1
    elif name == "position_ids":
        grown[..., prompt:] = value[..., -1:] + torch.arange(1, width - prompt + 1)
    elif filler:
        grown[..., prompt:] = value[..., -1:]
    return grown


def token_input_index(model_name: str, front: FrontEnd) -> int:
    """The flat index of the token-id input (``input_ids``, else the one sequence input).

    Raises:
        RuntimeInputError: the model has no single sequence input.
    """
    names = front.signature.user_inputs
    if "input_ids" in names:
        return names.index("input_ids")
    seq = [i for i, n in enumerate(names) if n in front.ctx.seq_inputs]
    if len(seq) != 1:
        raise RuntimeInputError(
            f"generate needs exactly one sequence input (token ids); {model_name} has "
            f"{[names[i] for i in seq]}. fix: compile with the token ids as the only one")
    return seq[0]


def logits_output(model_name: str, front: FrontEnd) -> int:
    """The flat index of the first per-token output (the logits).

    Raises:
        RuntimeInputError: the model returns no per-token output.
    """
    for j, axis in enumerate(front.signature.output_axes):
        if axis is not None:
            return j
    raise RuntimeInputError(f"{model_name} returns no per-token output (logits) to decode")
