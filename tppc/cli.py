"""The ``tppc`` command: ``tppc demo``, ``tppc graph``, ``tppc plan`` (MODULE:FACTORY)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tppc.errors import TppcError

__all__ = ["load_factory", "main"]


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Import ``MODULE:FACTORY`` and call it; returns ``(model, args, kwargs)``."""
    if ":" not in spec:
        raise TppcError(
            f"{spec!r} is not MODULE:FACTORY; fix: e.g. tppc.examples:gpt or mypkg.models:make"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TppcError(f"cannot import module {module_name!r} of {spec!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise TppcError(f"{module_name} has no callable {attr!r}; callables there: {names}")
    result = factory()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TppcError(
            f"{spec} returned {type(result).__name__}; it must return (model, args) or "
            "(model, args, kwargs)"
        )
    model, args, *rest = result
    return model, tuple(args), dict(rest[0]) if rest else {}


def _graph(ns: argparse.Namespace) -> int:
    from tppc.analysis import annotate
    from tppc.inspect import layer_table

    model, args, kwargs = load_factory(ns.factory)
    gm, ctx = annotate(model, args, kwargs)
    print(layer_table(gm, ctx))
    return 0


def _plan(ns: argparse.Namespace) -> int:
    from tppc.planner import Workload
    from tppc.planning import plan

    model, args, kwargs = load_factory(ns.factory)
    workload = Workload(kind="diffusion", steps=ns.steps) if ns.steps else None
    result = plan(model, args, kwargs, cluster=ns.cluster, seq_len=ns.seq_len,
                  granularity=ns.granularity, workload=workload, time_limit=ns.time_limit,
                  verbose=True)
    print(result.to_json() if ns.json else result.summary())
    return 0


def _demo(ns: argparse.Namespace) -> int:
    from tppc.demo import run_demo

    return run_demo(quick=ns.quick)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tppc`` console script."""
    parser = argparse.ArgumentParser(prog="tppc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture, plan, run and check small models end to end")
    demo.add_argument("--quick", action="store_true", help="smaller models, fewer checks")
    demo.set_defaults(fn=_demo)
    graph = sub.add_parser("graph", help="print the layer table of MODULE:FACTORY")
    graph.add_argument("factory", help="e.g. tppc.examples:hf_llama")
    graph.set_defaults(fn=_graph)
    pl = sub.add_parser("plan", help="capture, price and plan MODULE:FACTORY on a cluster")
    pl.add_argument("factory", help="e.g. tppc.examples:hf_llama")
    pl.add_argument("--cluster", default="2xcpu", help="e.g. 8xh100-sxm, 2xh100-sxm+2xa100-80gb")
    pl.add_argument("--seq-len", type=int, default=None, help="tokens (default: the example's)")
    pl.add_argument("--granularity", type=int, default=None, help="chunk sizes are multiples")
    pl.add_argument("--steps", type=int, default=0, help="diffusion steps (DiT workloads)")
    pl.add_argument("--time-limit", type=float, default=10.0, help="solver seconds")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(fn=_plan)
    ns = parser.parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = ns.fn
    start = time.perf_counter()
    try:
        code = fn(ns)
    except TppcError as exc:
        print(f"tppc: error: {exc}", file=sys.stderr)
        return 2
    print(f"[tppc {ns.command}: {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
