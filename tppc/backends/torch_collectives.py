"""Collectives over torch.distributed: the process-group transport's collective actions.

Terms:
    process group: one ``torch.distributed`` group per named group of the lists, made by
        :func:`process_groups` on every rank in the same order (``new_group`` is itself
        collective), gloo on CPU and NCCL on GPUs as the default group is.
    exchange: :func:`run_collective` runs one collective action on this rank's values
        with the backend's own collective (the sums add in the backend's order); a ring
        shift is one send to the next member and one receive from the previous, posted
        together (``batch_isend_irecv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tppc.program.actions import Action, Groups
from tppc.program.collectives import parts

__all__ = ["process_groups", "run_collective"]


_GROUPS: dict[tuple[int, ...], Any] = {}
"""Process groups made so far in this process, by member ranks."""


def process_groups(groups: Groups) -> dict[str, Any]:
    """A process group per named group (made once per member set, on every rank in the
    order of ``groups``, which every rank reads from the same program)."""
    made = {}
    for name, members in groups:
        key = tuple(members)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(key))
        made[name] = _GROUPS[key]
    return made


def run_collective(act: Action, values: Sequence[Any], members: Sequence[int], rank: int,
                   group: Any) -> tuple[Any, ...]:
    """This rank's result of collective ``act`` on its ``values`` (tensors; other values
    pass through as they are) over ``group`` (the ranks ``members``)."""
    n, me = len(members), list(members).index(rank)
    out = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        value = value.contiguous()
        if act.kind == "all_reduce":
            total = value.clone()
            dist.all_reduce(total, group=group)
            out.append(total)
        elif act.kind == "all_gather":
            pieces = [torch.empty_like(value) for _ in range(n)]
            dist.all_gather(pieces, value.contiguous(), group=group)  # a slice written in place
            out.append(torch.cat(pieces, act.dims[0]))
        elif act.kind == "ring_shift":
            out.append(_ring_shift(value, members, me, group))
        elif act.kind == "reduce_scatter":
            parts(act, value.shape, n)
            pieces = [p.contiguous() for p in torch.tensor_split(value, n, act.dims[0])]
            mine = torch.empty_like(pieces[me])
            dist.reduce_scatter(mine, pieces, group=group)
            out.append(mine)
        else:
            parts(act, value.shape, n)
            send = [p.contiguous() for p in torch.tensor_split(value, n, act.dims[0])]
            got = [torch.empty_like(p) for p in send]
            dist.all_to_all(got, send, group=group)
            out.append(torch.cat(got, act.dims[1]))
    return tuple(out)


def _ring_shift(value: torch.Tensor, members: Sequence[int], me: int, group: Any
                ) -> torch.Tensor:
    """``value`` sent to the next member, the previous member's received (one neighbour
    exchange per member, posted together so no member waits on its own send)."""
    n = len(members)
    if n == 1:
        return value.clone()
    got = torch.empty_like(value)
    ops = [dist.P2POp(dist.isend, value, members[(me + 1) % n], group),
           dist.P2POp(dist.irecv, got, members[(me - 1) % n], group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got
