"""``tppc cost MODULE:FACTORY``: print the per-layer cost report of a model's chunk."""

from __future__ import annotations

import argparse

from tppc.driver.costing import cost_report
from tppc.examples.factory import load_factory

__all__ = ["add_cost_arguments", "cost_command"]


def add_cost_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tppc cost`` arguments to ``parser`` (for the CLI's subparser)."""
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="a function returning (model, args) or (model, args, kwargs)")
    parser.add_argument("--cluster", default="1xcpu", help="cluster string, e.g. 4xh100-sxm")
    parser.add_argument("--chunk", type=int, required=True, help="tokens in the chunk")
    parser.add_argument("--prefix", type=int, default=0, help="tokens before the chunk")
    parser.add_argument("--seq-len", type=int, default=None, help="full sequence length L")
    parser.add_argument("--device-index", type=int, default=0, help="device of the cluster")
    parser.add_argument("--formula", default=None, metavar="LAYER",
                        help="also print this layer's formulas")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def cost_command(ns: argparse.Namespace) -> int:
    """``tppc cost``: capture the factory's model and print its cost report; returns 0."""
    model, args, kwargs = load_factory(ns.factory)
    report = cost_report(model, args, kwargs, cluster=ns.cluster, chunk=ns.chunk,
                         prefix=ns.prefix, seq_len=ns.seq_len, device_index=ns.device_index)
    print(report.to_json() if ns.json else report)
    if ns.formula and not ns.json:
        print()
        print(report.formula(ns.formula))
    return 0
