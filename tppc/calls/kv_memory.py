"""Will a generation fit? The K/V buffers of ``prompt + max_new_tokens`` tokens, per device.

Terms:
    need: per device, the bytes of every K/V and state buffer its stages own at the full
        length (:meth:`tppc.program.program.BufferSpec.nbytes`) plus the sequence inputs grown
        to that length (token ids, masks, positions), which ``generate`` allocates up front.
    unit: what a buffer's length counts: a token, or in a block capture
        (:mod:`tppc.frontend.block_capture`) a block of ``k`` tokens; such a generation holds
        whole blocks, and the message says so (``= 11 tokens, held as 3 blocks of 4 = 12
        tokens``) with a bound on ``max_new_tokens`` in tokens.
    free: a CUDA device's free memory (``torch.cuda.mem_get_info``), or the host's
        ``MemAvailable`` for ``cpu`` (unknown elsewhere: not checked).
    pool: what one free memory serves. A device of one process; the ranks of a job that
        share one (the CPU ranks of one host share its RAM; ranks on one GPU share it) are
        charged together (:func:`tppc.distributed.generate.check_rank_memory`).

One rule for every ``generate``: :func:`refuse_unfitting` judges needs against free memory
and words the refusal, torch-free, so that the in-process pipeline
(:func:`check_generation_memory`), the ranks of a job and the loaded artifact
(``runner.generate``, numpy buffers in host memory) refuse alike. This module imports torch
only inside the functions that read torch tensors or devices.

A need above the free memory is refused before anything is allocated, naming both numbers
and the largest ``max_new_tokens`` that fits: a generation never starts only to fail when
its buffers are allocated (``max_new_tokens=10**9`` once ran 41 s, then asked for 256 GB).

Example:
    >>> check_generation_memory(program, front, flat, prompt=16, max_new_tokens=10**9)
    ... # doctest: +SKIP
    RuntimeInputError: 16 prompt tokens + max_new_tokens=1000000000 = 1000000016 tokens need
    961.1 GiB on cpu (...), which has 19.6 GiB free. fix: lower max_new_tokens to at most ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tppc.errors import RuntimeInputError

__all__ = ["check_generation_memory", "free_bytes", "generation_need", "held_units",
           "host_free_bytes", "refuse_unfitting"]


def held_units(prompt: int, max_new_tokens: int, block: int = 1) -> int:
    """Units a generation's buffers hold: ``prompt + max_new_tokens`` tokens, or for a block
    capture the whole blocks of ``block`` tokens holding them, 2 at least (the capture runs 2
    blocks at least)."""
    total = prompt + max_new_tokens
    return total if block == 1 else max(2, -(-total // block))


def check_generation_memory(program: Any, front: Any, flat: Sequence[Any], prompt: int,
                            max_new_tokens: int, *, block: int = 1,
                            units: int | None = None) -> None:
    """Refuse a generation whose need exceeds a device's free memory (module docstring).

    Args:
        program: the prompt's :class:`tppc.program.program.Program` (its stages' buffers).
        front: the call's front end (which inputs are sequence inputs).
        flat: the bound flat inputs.
        prompt: prompt tokens.
        max_new_tokens: tokens to generate at most.
        block: tokens per unit of the buffers (a block capture's ``k``; 1 otherwise).
        units: units the buffers hold (default: ``⌈(prompt + max_new_tokens) / block⌉``).

    Raises:
        RuntimeInputError: naming the tokens, the need, the device, its free memory, the fix.
    """
    units = -(-(prompt + max_new_tokens) // block) if units is None else units
    need = generation_need(program, front, flat, units, block)
    refuse_unfitting(need, free_bytes, prompt, max_new_tokens,
                     block=block, units=units)


def generation_need(program: Any, front: Any, flat: Sequence[Any], units: int,
                    block: int = 1) -> dict[Any, int]:
    """Bytes per torch device of a generation holding ``units`` units of ``block`` tokens:
    every stage's K/V and state buffers, and the sequence inputs of ``flat`` grown to
    ``units · block`` positions (any length now: their bytes per position are taken)."""
    import torch

    need: dict[Any, int] = {}
    for stage in program.stages:
        kv = sum(b.nbytes(units) for b in stage.buffers)
        need[stage.device] = need.get(stage.device, 0) + kv
    for name, value in zip(front.signature.user_inputs, flat):
        axes = front.ctx.seq_inputs.get(name)
        if axes and isinstance(value, torch.Tensor) and value.shape[axes[0]]:
            per_token = value.numel() // value.shape[axes[0]] * value.element_size()
            need[value.device] = need.get(value.device, 0) + per_token * units * block
    return need


def refuse_unfitting(need: Mapping[Any, int], free: Callable[[Any], int | None],
                     prompt: int, max_new_tokens: int, *, block: int = 1,
                     units: int | None = None) -> None:
    """Refuse a generation whose ``need`` (bytes per device or pool, at ``units`` units of
    ``block`` tokens) exceeds its ``free(device)`` bytes (None: unknown, not checked); the
    one rule and message of every ``generate`` (module docstring). Torch-free.

    Raises:
        RuntimeInputError: naming the tokens (and the blocks holding them), the need, the
            device, its free memory and the largest ``max_new_tokens`` that fits.
    """
    total = prompt + max_new_tokens
    units = -(-total // block) if units is None else units
    for device, nbytes in need.items():
        room = free(device)
        if room is None or nbytes <= room:
            continue
        fits = int(room / (nbytes / units)) * block - prompt
        hint = (f"lower max_new_tokens to at most {fits}" if fits >= 1 else
                "use a shorter prompt, a smaller batch, or a device with more memory")
        held = "" if block == 1 else \
            f", held as {units} blocks of {block} = {units * block} tokens,"
        raise RuntimeInputError(
            f"{prompt} prompt tokens + max_new_tokens={max_new_tokens} = {total} tokens{held} "
            f"need {nbytes / 2**30:,.1f} GiB on {device} (K/V and state buffers of its stages "
            f"and the grown inputs), which has {room / 2**30:,.1f} GiB free. fix: {hint}")


def free_bytes(device: Any) -> int | None:
    """Free memory of a torch ``device`` in bytes (None: unknown)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    return host_free_bytes() if device.type == "cpu" else None


def host_free_bytes() -> int | None:
    """The host's ``MemAvailable`` in bytes (None: unknown). Torch-free."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
