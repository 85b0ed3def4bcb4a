"""The pass runner: runs ``(gm, ctx) -> gm`` passes, timing and linting each one.

``TPPC_DEBUG=1`` prints each pass and its time; ``TPPC_DEBUG=2`` also prints the graph after
it. Every run leaves a :class:`tppc.ir.context.PassRecord` on ``ctx.history``; after the
capture's own records (``ctx.captured_passes``), the latest :data:`EMISSION_RECORDS` of the
emissions (a pipeline re-plans per new length) are kept, so the history stays bounded.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence

from torch import fx

from tppc.errors import PassError, TppcError
from tppc.ir.context import CompileContext, PassRecord

__all__ = ["EMISSION_RECORDS", "Pass", "run_passes"]

EMISSION_RECORDS = 16
"""Records of emissions (after the capture's) kept in ``ctx.history``."""

Pass = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]


def run_passes(gm: fx.GraphModule, ctx: CompileContext, passes: Sequence[Pass]) -> fx.GraphModule:
    """Run ``passes`` in order; re-raise failures as :class:`PassError` naming the pass.

    A :class:`TppcError` raised on purpose by a pass keeps its type; its message is prefixed
    with the pass name.
    """
    level = int(os.environ.get("TPPC_DEBUG", "0") or 0)
    for fn in passes:
        name = fn.__name__.removesuffix("_pass")
        start = time.perf_counter()
        try:
            gm = fn(gm, ctx)
            gm.graph.lint()
        except TppcError as exc:
            exc.args = (f"[pass {name}] {exc.args[0] if exc.args else ''}", *exc.args[1:])
            raise
        except Exception as exc:
            raise PassError(f"pass {name} failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        ctx.history.append(PassRecord(name, seconds, len(gm.graph.nodes), gm.code))
        if ctx.captured_passes is not None \
                and len(ctx.history) > ctx.captured_passes + EMISSION_RECORDS:
            del ctx.history[ctx.captured_passes]  # the oldest emission's record
        if level >= 1:
            print(f"[tppc] pass {name}: {seconds * 1e3:.1f} ms, {len(gm.graph.nodes)} nodes",
                  file=sys.stderr)
        if level >= 2:
            print(gm.code, file=sys.stderr)
    return gm
