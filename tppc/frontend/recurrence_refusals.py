"""Refusals of recurrences torch.export fixes to the example's length, named by construct.

Terms:
    loop over positions: a recurrence stepped in a Python loop as long as the sequence
        (position by position, or block by block); torch.export unrolls it at the example's
        length (:func:`tppc.frontend.guard_sites.loop_over_positions`). tppc re-rolls it
        (:mod:`tppc.frontend.reroll_capture`) and refuses it only when that fails (the
        reason is part of the refusal).
    block padding: the sequence padded to a multiple of a constant ``k`` and reshaped into
        blocks of ``k`` rows, with a recurrence over the blocks (a chunked scan: Mamba2's SSD
        scan, Gated DeltaNet's chunked delta rule); torch.export pins the length, because
        the padding is a function of ``L mod k`` (:class:`tppc.frontend.guard_sites.GuardLog`);
        tppc exports it again with ``L = k × blocks`` (:mod:`tppc.frontend.block_capture`)
        and refuses it only when that fails too (Qwen3-Next: a Python loop over the blocks).

Both stop the first export, from the first export's guards, before the exports that re-roll
a loop or capture blocks, and before annotation runs (the export stops at the guard that shows the construct: the rest is minutes
of symbolic reasoning about the padded length, or the unrolled loop): a token chunk cannot
run either graph.
"""

from __future__ import annotations

import torch

from tppc.frontend.guard_sites import describe_sites

__all__ = ["block_refusal", "loop_refusal"]

_SCAN_FIX = (
    "write the recurrence as a scan over the token axis that torch.export captures with a "
    "symbolic length (torch.cumsum / torch.logcumsumexp / torch.cumprod, e.g. a log-space "
    "linear recurrence as minGRU's parallel form) and a short convolution as "
    "conv1d(padding=k - 1)[..., :L]: tppc carries their state from chunk to chunk "
    "(docs/annotation.md#recurrent-layers-carried-state)")


def loop_refusal(model: torch.nn.Module, site: tuple[str, str], exc: Exception,
                 reroll: object) -> str:
    """The refusal of a recurrence stepped in a Python loop as long as the sequence, when
    re-rolling it failed (``reroll``: why, :mod:`tppc.frontend.reroll_capture`)."""
    why = f"{type(reroll).__name__}: {reroll}" if isinstance(reroll, Exception) else reroll
    return (
        f"torch.export could not capture {type(model).__name__}: a Python loop whose count "
        f"is the sequence length at {site[0]} (`{site[1]}`), a recurrence stepped position "
        "by position (or block by block); torch.export unrolls it at the example's length "
        "(one copy of the step per position or block), so the sequence length is fixed to "
        "the example and no chunk can run it. tppc re-rolls such a loop into one node when "
        "its steps are one computation with a carried state and outputs stacked along the "
        f"tokens (docs/capture.md#re-rolled-loops); here that failed: {why}.\n"
        f"fix: {_SCAN_FIX}.\n"
        f"torch.export stopped at: {type(exc).__name__}: {str(exc).strip()}")


def block_refusal(model: torch.nn.Module, block: int, sites: list[tuple[str, int, str]]
                  ) -> str:
    """The refusal of a sequence padded to a multiple of ``block`` and reshaped into blocks,
    when the export with the length ``block × blocks`` failed too (:mod:`.block_capture`;
    named from the guards of the first export, which stopped at the first)."""
    where = "; ".join(describe_sites(sites)) or "a line inside torch"
    return (
        f"torch.export could not capture {type(model).__name__} with a symbolic length: the "
        f"sequence is padded to a multiple of {block} and reshaped into blocks of {block} "
        f"rows (a chunked scan: a state-space model's SSD scan, a chunked delta rule or "
        f"chunked linear attention, with a recurrence over the blocks) at {where}. The "
        f"padding is a function of the length modulo {block}, so torch.export fixes the "
        f"length to the example; tppc exported it again with the length {block} × blocks "
        "(docs/capture.md#specialised-captures), which failed too (below).\n"
        f"fix: run this model unsplit (eager, or torch.compile); for a model of one's own, "
        f"{_SCAN_FIX}, or pad to blocks as Mamba2 does (a scan over the blocks, or an "
        "initial-state slot: docs/annotation.md#block-scans-a-recurrence-over-blocks-of-the-"
        "token-axis).")
