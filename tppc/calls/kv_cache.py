"""Read the K/V of a pipeline's last call (what ``CompiledPipeline.kv_cache`` returns)."""

from __future__ import annotations

from typing import Any

import torch

from tppc.errors import RuntimeInputError

__all__ = ["read_kv_cache"]


def read_kv_cache(last: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Every attention's (K, V) over the last call's tokens, in layer order (copies).

    ``last``: ``(state, uses, front)`` of the last call, or None before the first.

    Raises:
        RuntimeInputError: no call has finished yet, or a later call reused its buffers.
    """
    if last is None or not last[0].filled:
        raise RuntimeInputError("kv_cache() is empty: run a prefill (cp(input_ids)) first")
    state, uses, front = last
    if state.uses != uses:
        raise RuntimeInputError("kv_cache(): the last call's K/V buffers were reused by a "
                                "later call. fix: call kv_cache() right after the call")
    out = []
    for attn in front.signature.attention:
        pair = []
        for which in ("key", "value"):
            buf = next(b for b in front.signature.buffers
                       if b.spec.source == attn and b.spec.kind == which)
            tensor = state.buffer(buf.name)
            pair.append(tensor.narrow(buf.spec.axis, 0, state.filled).clone())
        out.append((pair[0], pair[1]))
    return tuple(out)
