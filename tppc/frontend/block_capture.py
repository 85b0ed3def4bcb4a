"""Capture a model that pads its sequence to whole blocks with a symbolic number of blocks.

Terms:
    block padding: the sequence padded to a multiple of a constant ``k`` and reshaped into
        blocks of ``k`` rows (Mamba2's chunked SSD scan: ``pad_size = (k - L % k) % k``,
        ``reshape(b, -1, k, ...)``); torch.export guards on ``Mod(L, k)``
        (:class:`tppc.frontend.guard_sites.GuardLog`), so a plain ``Dim`` on the length
        fixes it to the example.
    block capture: the export again with the length a derived dim ``L = k·n`` (torch.export's
        ``k * Dim("blocks")``): ``L mod k`` is then symbolically 0, the padding is empty and
        the graph's shapes carry ``n``, the number of blocks. ``n`` becomes the sequence
        symbol, so a unit of the plan is one block of ``k`` tokens: every chunk boundary is
        a multiple of ``k`` (as a DiT's unit is a patch row), and a call's length must be a
        multiple of ``k`` (:func:`check_block_length`). The token count is ``k·n``
        (``ctx.token_count``), so the planner prices tokens on a grid of ``k`` and a plan
        says ``tokens_per_unit = k`` (``seq_len=4 blocks of 4 tokens (16 tokens)``), as it
        does for a block capture with attention, whose annotation finds that count.

Whether the recurrence over the blocks can then be chunked is annotation's question
(:mod:`tppc.passes.annotation.block_scan`); this module only captures.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tppc.errors import CaptureError, RuntimeInputError
from tppc.frontend.guard_sites import GuardLog, describe_site, guard_sites, loop_over_positions
from tppc.frontend.recurrence_refusals import block_refusal
from tppc.ir.context import CompileContext

__all__ = ["block_shapes", "check_block_length", "export_blocks"]


def block_shapes(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                 block: int, units: int, upper: int,
                 spec_for: Callable[[str, Any, Any], Any]) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` with every sequence axis ``block * Dim("blocks")``.

    Raises:
        CaptureError: the example's length is no multiple of ``block`` of at least two
            blocks (torch.export specialises a dim of 0 or 1), naming the fix.
    """
    if units % block or units // block < 2:
        raise CaptureError(
            f"the example sequence of {units} tokens is padded by the model to a multiple of "
            f"{block} (a chunked scan over blocks of {block} rows); tppc captures such a model "
            f"with a symbolic number of blocks, which needs an example of a whole number of "
            f"blocks, at least 2. fix: capture with an example of {max(2, -(-units // block))}"
            f" × {block} = {max(2, -(-units // block)) * block} tokens")
    blocks = torch.export.Dim("blocks", min=2, max=max(upper // block, units // block + 1))
    dim = block * blocks
    shapes: dict[str, Any] = {}
    sig = bound.signature
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: spec_for(k, v, dim) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(None for _ in value)
        else:
            shapes[name] = spec_for(name, value, dim)
    return shapes


def export_blocks(model: torch.nn.Module, log: GuardLog, export: Callable[[], fx.GraphModule],
                  first: Exception, example: tuple[dict[str, tuple[int, ...]], int],
                  finish: tuple[Callable[[fx.GraphModule], None], Callable[..., Any]],
                  reroll: Callable[[tuple[str, str], int], Any] | None = None
                  ) -> tuple[fx.GraphModule, CompileContext]:
    """The block capture (``export`` with :func:`block_shapes`) and its context: ``dynamic``,
    the symbol counts blocks, ``block_size`` is ``k``. ``example`` is the sequence axes and
    the example's tokens; ``finish`` drops a GraphModule's guards and finds its symbol;
    ``reroll(site, k)`` re-rolls a Python loop over the blocks that stopped that export
    (:mod:`.reroll_capture`, with units of ``k`` tokens), raising ``CaptureError`` if not.

    Raises:
        CaptureError: that export failed too (:func:`block_refusal`, with its error).
    """
    axes, units = example
    drop, symbol_of = finish
    block = log.block
    try:
        with guard_sites(stop=True, blocks=False) as again:  # stopped at a loop over blocks
            gm = export()
    except Exception as exc:  # torch raises many types; the construct is named
        site = describe_site(again.sites[-1:])  # the guard that stopped it
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        if site is not None and loop_over_positions(site[1]):
            reason = "no re-roller was given"
            if reroll is not None:
                try:
                    return reroll(site, block)
                except CaptureError as failed:
                    reason = str(failed).partition("here that failed: ")[2].partition(
                        ".\nfix:")[0] or str(failed).splitlines()[0]
            why = (f"a Python loop over the blocks at {site[0]} (`{site[1]}`), which "
                   "torch.export unrolls at the example's number of blocks (a recurrence "
                   "stepped block by block, e.g. a chunked delta rule); re-rolling it "
                   f"(docs/capture.md#re-rolled-loops) failed: {reason}")
        raise CaptureError(block_refusal(model, block, log.block_sites) + "\nThe export with "
                           f"the length {block} × blocks failed too: {why}.") from first
    guards = getattr(gm, "_guards_fn", None)
    drop(gm)
    symbol = symbol_of(gm, axes)
    if symbol is None:
        raise CaptureError(block_refusal(model, block, log.block_sites) + "\nThe export with "
                           f"the length {block} × blocks fixed the number of blocks to the "
                           "example's.") from first
    ctx = CompileContext(  # k tokens per block: priced, planned and named in tokens
        seq_symbol=symbol, example_seq=units // block, seq_inputs=dict(axes),
        token_count=block * symbol,
        capture_mode="dynamic", input_names=tuple(n.name for n in gm.graph.nodes
                                                  if n.op == "placeholder"),
        shape_guards=guards, block_size=block)
    return gm, ctx


def check_block_length(name: str, block: int, tokens: int, model: str) -> None:
    """Refuse a call whose sequence is no whole number of blocks, at least 2 (torch.export
    specialised fewer: see the module docstring)."""
    if tokens % block or tokens < 2 * block:
        raise RuntimeInputError(
            f"input {name!r} has {tokens} tokens; {model} pads its sequence to a multiple of "
            f"{block} (a chunked scan over blocks of {block} rows) and tppc ran it with a "
            f"symbolic number of blocks, so a call's length must be a whole number of blocks, "
            f"at least 2. fix: pass {max(2 * block, -(-tokens // block) * block)} tokens "
            "(pad the prompt on the left), or run this model eagerly")

