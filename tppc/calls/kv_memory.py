"""Will a generation fit? The K/V buffers of ``prompt + max_new_tokens`` tokens, per device.

Terms:
    need: per device, the bytes of every K/V buffer its stages own at the full length
        (:meth:`tppc.program.program.BufferSpec.nbytes`) plus the sequence inputs grown to
        that length (token ids, masks, positions), which ``generate`` allocates up front.
    free: a CUDA device's free memory (``torch.cuda.mem_get_info``), or the host's
        ``MemAvailable`` for ``cpu`` (unknown elsewhere: not checked).

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

from collections.abc import Sequence
from typing import Any

import torch

from tppc.errors import RuntimeInputError

__all__ = ["check_generation_memory", "free_bytes"]


def check_generation_memory(program: Any, front: Any, flat: Sequence[Any], prompt: int,
                            max_new_tokens: int) -> None:
    """Refuse a generation whose need exceeds a device's free memory (module docstring).

    Args:
        program: the prompt's :class:`tppc.program.program.Program` (its stages' buffers).
        front: the call's front end (which inputs are sequence inputs).
        flat: the bound flat inputs.
        prompt: prompt tokens.
        max_new_tokens: tokens to generate at most.

    Raises:
        RuntimeInputError: naming the tokens, the need, the device, its free memory, the fix.
    """
    total = prompt + max_new_tokens
    need: dict[torch.device, int] = {}
    for stage in program.stages:
        kv = sum(b.nbytes(total) for b in stage.buffers)
        need[stage.device] = need.get(stage.device, 0) + kv
    for name, value in zip(front.signature.user_inputs, flat):
        axes = front.ctx.seq_inputs.get(name)
        if axes and isinstance(value, torch.Tensor) and value.shape[axes[0]]:
            grown = value.numel() // value.shape[axes[0]] * total * value.element_size()
            need[value.device] = need.get(value.device, 0) + grown
    for device, nbytes in need.items():
        free = free_bytes(device)
        if free is None or nbytes <= free:
            continue
        fits = int(free / (nbytes / total)) - prompt
        hint = (f"lower max_new_tokens to at most {fits}" if fits >= 1 else
                "use a shorter prompt, a smaller batch, or a device with more memory")
        raise RuntimeInputError(
            f"{prompt} prompt tokens + max_new_tokens={max_new_tokens} = {total} tokens need "
            f"{nbytes / 2**30:,.1f} GiB on {device} (K/V buffers of its stages and the grown "
            f"inputs), which has {free / 2**30:,.1f} GiB free. fix: {hint}")


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
