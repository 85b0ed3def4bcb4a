"""The ``tppc`` command: ``demo``, ``graph`` / ``cost`` / ``plan`` / ``export`` of a
MODULE:FACTORY, and ``run`` of an exported artifact."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tppc.cli.checks import check_arguments, degrees_arg, lengths_arg
from tppc.errors import TppcError
from tppc.examples.factory import load_factory

__all__ = ["main"]


def _graph(ns: argparse.Namespace) -> int:
    from tppc.frontend.annotate import annotate
    from tppc.report.layers import layer_table

    model, args, kwargs = load_factory(ns.factory)
    gm, ctx = annotate(model, args, kwargs)
    print(layer_table(gm, ctx))
    return 0


def _plan(ns: argparse.Namespace) -> int:
    from tppc.driver.planning import plan
    from tppc.planner import Workload

    model, args, kwargs = load_factory(ns.factory)
    workload = Workload(kind="diffusion", steps=ns.steps) if ns.steps else None
    result = plan(model, args, kwargs, cluster=ns.cluster, seq_len=ns.seq_len,
                  granularity=ns.granularity, workload=workload, time_limit=ns.time_limit,
                  num_stages=ns.stages, tensor_parallel=ns.tensor_parallel,
                  intra_op=ns.intra_op, verbose=True)
    print(result.to_json() if ns.json else result.summary())
    if ns.png:
        from tppc.report.timeline import draw_timeline

        print(f"Gantt chart written to {draw_timeline(result, ns.png)}", file=sys.stderr)
    if ns.trace:
        from tppc.report.trace import write_plan_trace

        path = write_plan_trace(result, ns.trace)
        print(f"predicted schedule written to {path} (open it in ui.perfetto.dev)",
              file=sys.stderr)
    return 0


def _export(ns: argparse.Namespace) -> int:
    from tppc.artifact.core.load import plan_digest
    from tppc.artifact.writer.write import export
    from tppc.dispatch.compile import compile_pipeline

    lengths = lengths_arg(ns.lengths)  # refused before the model is compiled
    model, args, kwargs = load_factory(ns.factory)
    options: dict[str, Any] = {"num_stages": ns.stages} if ns.stages else {}
    if ns.chunks:
        options["chunks"] = ns.chunks
    if ns.tensor_parallel:
        options["tensor_parallel"] = ns.tensor_parallel
    compiled = compile_pipeline(model, args, kwargs, cluster=ns.cluster, **options)
    out = export(compiled, ns.out, lengths=lengths,
                 progress=lambda line: print(line, file=sys.stderr))
    print(f"wrote {out}/plan.json and {len(compiled.plan.stages)} stage(s); plan.json sha256 "
          f"{plan_digest(out)} (tppc run --expected-sha256 refuses any other artifact)")
    return 0


def _run(ns: argparse.Namespace) -> int:
    from tppc.artifact.core.run import run_artifact

    return run_artifact(ns.artifact, ns.input, ns.output, threads=ns.threads,
                        generate=ns.generate or 0, expected_sha256=ns.expected_sha256)


def _needs_torch(ns: argparse.Namespace) -> int:
    raise TppcError(f"tppc {ns.command} needs torch, which does not import here. fix: "
                    "install torch (only `tppc run` works without it)")


def _demo(ns: argparse.Namespace) -> int:
    from tppc.examples.demo import run_demo

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
    cost = sub.add_parser("cost", help="per-layer cost report of MODULE:FACTORY on a device")
    try:
        from tppc.cli.cost import add_cost_arguments, cost_command
    except ImportError:  # no torch on this machine: `tppc run` still works
        cost.set_defaults(fn=_needs_torch)
    else:
        add_cost_arguments(cost).set_defaults(fn=cost_command)
    pl = sub.add_parser("plan", help="capture, price and plan MODULE:FACTORY on a cluster")
    pl.add_argument("factory", help="e.g. tppc.examples:hf_llama")
    pl.add_argument("--cluster", default="2xcpu", help="e.g. 8xh100-sxm, 2xh100-sxm+2xa100-80gb")
    pl.add_argument("--seq-len", type=int, default=None,
                    help="length in the plan's unit: tokens, or patch rows for a DiT "
                         "(default: the example's)")
    pl.add_argument("--granularity", type=int, default=None, help="chunk sizes are multiples")
    pl.add_argument("--steps", type=int, default=None,
                    help="diffusion steps (DiT workloads; default: one pass)")
    pl.add_argument("--time-limit", type=float, default=10.0, help="solver seconds")
    pl.add_argument("--stages", type=int, default=None, help="number of stages (default: planned)")
    pl.add_argument("--tensor-parallel", type=degrees_arg, default=None, metavar="T[,T...]",
                    help="tensor-parallel degree of every stage, or one per stage "
                         "(default: planned)")
    pl.add_argument("--intra-op", type=int, default=None, metavar="K",
                    help="CPU devices per stage run by one worker of K intra-op threads "
                         "(1: none; default: planned on CPU clusters)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--png", default=None, metavar="FILE",
                    help="draw the predicted schedule as a Gantt chart (needs matplotlib)")
    pl.add_argument("--trace", default=None, metavar="FILE",
                    help="write the predicted schedule as a Chrome trace (JSON)")
    pl.set_defaults(fn=_plan)
    ex = sub.add_parser("export", help="compile MODULE:FACTORY and write it as ONNX stages")
    ex.add_argument("factory", help="e.g. tppc.examples:hf_llama")
    ex.add_argument("--cluster", default="2xcpu", help="e.g. 2xcpu, 4xh100-sxm")
    ex.add_argument("--out", required=True, help="artifact directory to write")
    ex.add_argument("--lengths", nargs="*", default=None,
                    help="sequence lengths to record chunks for (default: the example's)")
    ex.add_argument("--stages", type=int, default=None, help="number of stages")
    ex.add_argument("--chunks", type=int, default=None, help="equal chunks (default: planned)")
    ex.add_argument("--tensor-parallel", type=degrees_arg, default=None, metavar="T[,T...]",
                    help="tensor-parallel degree of every stage, or one per stage (one ONNX "
                    "graph per part of every shard)")
    ex.set_defaults(fn=_export)
    rn = sub.add_parser("run", help="run an exported artifact on ONNX Runtime")
    rn.add_argument("artifact", help="directory written by tppc export")
    rn.add_argument("--input", required=True, help=".npz with one array per model input")
    rn.add_argument("--output", required=True, help=".npz to write the outputs to")
    rn.add_argument("--threads", type=int, default=None, help="intra-op threads per stage")
    rn.add_argument("--generate", type=int, default=None, metavar="N",
                    help="greedy-generate N tokens instead (output 'ids')")
    rn.add_argument("--expected-sha256", default=None, metavar="HEX",
                    help="refuse the artifact unless its plan.json has this sha256 (the "
                         "digest tppc export printed)")
    rn.set_defaults(fn=_run)
    ns = parser.parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = ns.fn
    start = time.perf_counter()
    try:
        check_arguments(ns)  # every number and path, before the model is loaded
        code = fn(ns)
    except TppcError as exc:
        print(f"tppc: error: {exc}", file=sys.stderr)
        return 2
    print(f"[tppc {ns.command}: {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
