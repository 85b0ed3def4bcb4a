"""``python -m tppc.cli.rank``: one rank of a multi-process pipeline job (start it with torchrun).

Example (two stages on this machine; see README "torch.distributed" for several nodes;
``--tensor-parallel 2`` with 4 processes: two stages of two shards each, one rank per shard):

    torchrun --nproc-per-node 2 -m tppc.cli.rank tppc.examples:hf_llama \\
        --checkpoint llama.safetensors --input inputs.npz --output out.npz

Every rank builds the model from ``MODULE:FACTORY`` with its parameters on the meta device,
captures it, takes rank 0's plan, loads only its own stage's tensors from the checkpoint and
runs its stage. Inputs (``--input``, an ``.npz`` with ``args.0``, ``args.1``, ...,
``kwargs.NAME``; default: the factory's example inputs, drawn with the weights on meta, so
random ones differ from an eager run's) are read and validated on rank 0.
Rank 0 writes the outputs (``out.0``, ``out.1``, ... the model's flat outputs, ``ids``
with ``--generate N``, or ``latents`` with ``--denoise STEPS``: the latents are ``args.0``,
the model's other inputs ``kwargs.NAME``). ``--report DIR`` writes ``rank<r>.json`` per rank (times, memory, and
``calls`` and the last call's jobs ``trace`` as ``time.perf_counter`` stamps, comparable
between the ranks of one machine).
A rank that fails prints ``[tppc.run rank r] StageFailed: ...`` and exits with status 1.

With an artifact directory written by ``tppc.export`` instead of ``MODULE:FACTORY``
(``torchrun --nproc-per-node S -m tppc.cli.rank DIR --input in.npz --output out.npz``), rank
``r`` verifies and loads only stage ``r``'s ONNX file and runs it on ONNX Runtime
(:mod:`tppc.artifact.torch_runners.distributed`); the inputs are named as in ``plan.json``'s
signature (``args.N`` / ``kwargs.NAME`` work too) and the outputs by their path, like
``tppc run DIR``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tppc.cli.checks import degrees_arg

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tppc.cli.rank", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", help="MODULE:FACTORY returning (model, args[, kwargs]), or a "
                   "directory written by tppc.export (holding plan.json)")
    p.add_argument("--factory-kwargs", default="{}", help="JSON keywords of the factory")
    p.add_argument("--checkpoint", help="safetensors file of the weights (default: the "
                   "factory's own weights, the whole model on every rank)")
    p.add_argument("--input", help=".npz of the inputs (default: the factory's examples)")
    p.add_argument("--output", help=".npz written by rank 0")
    p.add_argument("--generate", type=int, metavar="N", help="greedy-generate N tokens")
    p.add_argument("--denoise", type=int, metavar="STEPS", help="PipeFusion-denoise the "
                   "latents (args.0; the model's other inputs as kwargs.NAME) in STEPS steps")
    p.add_argument("--warmup-steps", type=int, default=1, help="denoise warm-up steps")
    p.add_argument("--patches", type=int, help="denoise patches (default: planned)")
    p.add_argument("--timestep-arg", default="timestep", help="the model's timestep input")
    p.add_argument("--scheduler", default="diffusers:DDIMScheduler",
                   help="MODULE:CLASS of the denoise scheduler")
    p.add_argument("--scheduler-config", default="{}", help="JSON keywords of the scheduler "
                   "(e.g. '{\"use_dynamic_shifting\": true}')")
    p.add_argument("--sigmas", type=_floats, help="comma-separated custom sigmas of "
                   "set_timesteps (Flux: 1.0,0.75,0.5,0.25)")
    p.add_argument("--mu", type=float, help="set_timesteps' mu (dynamic shifting)")
    p.add_argument("--timestep-scale", type=float, help="the model's timestep is the "
                   "scheduler's times this (Flux, AuraFlow: 0.001)")
    p.add_argument("--cluster", help="cluster priced by the planner (default: <W>xcpu)")
    p.add_argument("--tensor-parallel", type=degrees_arg, metavar="T[,T...]",
                   help="tensor-parallel degree of every stage, or one per stage (the job "
                   "runs one rank per worker: W = the sum of the degrees)")
    for flag, what in (("--cfg-parallel", "copies of every stage's group, each running its "
                        "part of the guided batch"), ("--ulysses", "devices per stage "
                        "exchanging tokens for heads"), ("--ring", "devices per stage passing "
                                                          "K/V around")):
        p.add_argument(flag, type=int, metavar="N", help=f"{what} (the job runs one rank per "
                       "worker: W = stages x the product of the degrees)")
    p.add_argument("--chunks", type=int, help="equal chunks per call (default: planned)")
    p.add_argument("--threads", type=int, help="intra-op threads of a CPU stage")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits for a peer before it fails (default 60)")
    p.add_argument("--call-timeout", type=float, help="seconds a call may take before "
                   "StageTimeout (naming the stage awaited; default: no limit)")
    p.add_argument("--results", choices=("rank0", "all"), default="rank0")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--repeat", type=int, default=1, help="run the call this many times")
    p.add_argument("--report", help="directory for rank<r>.json (times, memory)")
    return p


def _factory(spec: str, kwargs: dict[str, Any]) -> Callable[[], tuple[Any, ...]]:
    from tppc.errors import SpecError

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SpecError(f"{spec!r} is not MODULE:FACTORY; fix: e.g. tppc.examples:hf_llama")
    factory = getattr(importlib.import_module(module_name), attr)

    def make() -> tuple[Any, ...]:
        result = factory(**kwargs)
        return result if len(result) == 3 else (*result, {})

    return make


def _load_inputs(path: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if path is None:
        return args, kwargs
    import numpy as np
    import torch

    with np.load(path) as data:
        arrays = {k: torch.from_numpy(data[k].copy()) for k in data.files}
    positional = sorted((int(k.split(".", 1)[1]), v) for k, v in arrays.items()
                        if k.startswith("args."))
    named = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("kwargs.")}
    return tuple(v for _, v in positional), named


def _rss_mib() -> float:
    """Peak resident memory of this process, MiB (``VmHWM``: unlike ``ru_maxrss`` it does not
    include the RSS of the parent that forked this process before ``exec``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _watchdog(rank: str, grace: float = 2.0) -> None:
    """Leave (status 1) once another rank recorded a failure and this one is still running
    ``grace`` seconds later: a rank stuck in an op (an NCCL hang, a hung stage) cannot
    outlive the job's failure."""
    from tppc.backends.rank_failure import read_failure
    from tppc.processes.rank_exit import cleanup, end_stopped_peers

    def watch() -> None:
        while True:
            record = read_failure(wait=0.0)
            if record is not None:
                time.sleep(grace)
                print(f"[tppc.run rank {rank}] StageFailed: {record} (stopped by the "
                      "watchdog)", file=sys.stderr, flush=True)
                end_stopped_peers()
                cleanup()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tppc-watchdog", daemon=True).start()


def _run(ns: argparse.Namespace) -> dict[str, Any]:
    from tppc.cli.checks import check_rank_arguments

    rank = os.environ.get("RANK")
    check_rank_arguments(ns, int(rank) if rank and rank.isdigit() else None)
    import numpy as np
    import torch
    from torch.utils import _pytree as pytree

    from tppc.distributed.checkpoint import empty_model
    from tppc.distributed.pipeline import compile_distributed

    if Path(ns.factory, "plan.json").is_file():
        return _run_artifact(ns)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    make = _factory(ns.factory, json.loads(ns.factory_kwargs))
    model, args, kwargs, buffers = empty_model(make)
    rss_start = _rss_mib()  # libraries and the empty model, before any weight is loaded
    options: dict[str, Any] = {}
    if ns.cluster:
        options["cluster"] = ns.cluster
    if ns.chunks:
        options["chunks"] = ns.chunks
    if ns.tensor_parallel:
        options["tensor_parallel"] = ns.tensor_parallel
    for name in ("cfg_parallel", "ulysses", "ring"):
        if getattr(ns, name) is not None:
            options[name] = getattr(ns, name)
    if ns.threads:
        options["threads_per_stage"] = ns.threads
    if ns.call_timeout is not None:  # 0 is refused by name, not ignored
        options["timeout"] = ns.call_timeout
    t0 = time.perf_counter()
    cp = compile_distributed(model, args, kwargs, checkpoint=ns.checkpoint, buffers=buffers,
                             results=ns.results, comm_timeout=ns.timeout, device=ns.device,
                             **options)
    compile_s = time.perf_counter() - t0
    _watchdog(str(cp.rank))
    rss_compiled = _rss_mib()
    if cp.rank == 0:
        args, kwargs = _load_inputs(ns.input, args, kwargs)
    times, calls, out = [], [], None
    for _ in range(ns.repeat):
        t0 = time.perf_counter()
        out = _call(cp, ns, args, kwargs)
        calls.append((t0, time.perf_counter()))
        times.append(calls[-1][1] - t0)
    if out is not None and ns.output and cp.rank == 0:  # results="all": one writer
        leaves = {"ids": out} if ns.generate else {"latents": out} if ns.denoise else {
            f"out.{j}": v for j, v in enumerate(pytree.tree_leaves(out))}
        np.savez(ns.output, **{k: v.detach().cpu().float().numpy() if v.dtype == torch.bfloat16
                               else v.detach().cpu().numpy() for k, v in leaves.items()
                               if isinstance(v, torch.Tensor)})
    stage = cp.program(cp.plan.seq_len).runners[cp.rank]
    return {"rank": cp.rank, "world": cp.world, "stage": stage.index,
            "layers": list(stage.layers), "degrees": dict(cp.plan.degrees),
            "times": times, "compile_s": compile_s, "weights_bytes": cp.weights.nbytes,
            "rss_start_mib": rss_start, "rss_compiled_mib": rss_compiled, "rss_peak_mib": _rss_mib(),
            "threads": torch.get_num_threads(), "chunks": list(cp.plan.chunks),
            "calls": calls, "trace": [list(job) for job in cp.last_trace], "pid": os.getpid()}


def _floats(text: str) -> list[float]:
    """``"1.0,0.5"`` → ``[1.0, 0.5]`` (argparse names the flag when one does not parse)."""
    return [float(v) for v in text.split(",") if v.strip()]


def _call(cp: Any, ns: argparse.Namespace, args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> Any:
    """One call of the job: generate, denoise, or the model's forward."""
    if ns.generate:
        return cp.generate(args[0] if args else None, ns.generate)
    if ns.denoise:
        module_name, _, attr = ns.scheduler.partition(":")
        config = json.loads(ns.scheduler_config)
        scheduler = getattr(importlib.import_module(module_name), attr)(**config)
        scale = ns.timestep_scale
        return cp.denoise(args[0] if args else None, scheduler, ns.denoise,
                          warmup_steps=ns.warmup_steps, patches=ns.patches,
                          model_kwargs=kwargs, timestep_arg=ns.timestep_arg,
                          sigmas=ns.sigmas, mu=ns.mu,
                          timestep_transform=None if scale is None else lambda t: t * scale)
    return cp(*args, **kwargs)


def _run_artifact(ns: argparse.Namespace) -> dict[str, Any]:
    """This rank's stage of an exported artifact (see the module docstring)."""
    import numpy as np

    from tppc.artifact.core.run import flat_outputs
    from tppc.artifact.torch_runners.distributed import load_distributed
    from tppc.errors import SpecError

    for flag in ("checkpoint", "chunks", "cluster"):
        if getattr(ns, flag):
            raise SpecError(f"--{flag} does not apply to the artifact directory {ns.factory} "
                            "(its plan, chunks and weights are fixed in it). fix: drop it")
    if ns.denoise:
        raise SpecError(f"--denoise needs MODULE:FACTORY, not the artifact directory "
                        f"{ns.factory} (its stages run ONNX, without the PipeFusion loop). "
                        "fix: start the job from the model's factory and a checkpoint")
    if ns.device == "cuda" or ns.input is None:
        raise SpecError(f"an artifact directory ({ns.factory}) runs on CPU and needs --input "
                        "(an .npz of its inputs). fix: pass --input, not --device cuda")
    rss_start = _rss_mib()
    t0 = time.perf_counter()
    runner = load_distributed(ns.factory, threads_per_stage=ns.threads, results=ns.results,
                              comm_timeout=ns.timeout)
    load_s = time.perf_counter() - t0
    _watchdog(str(runner.rank))
    rss_loaded = _rss_mib()
    arrays: dict[str, Any] = {}
    if runner.rank == 0:
        with np.load(ns.input, allow_pickle=False) as data:
            arrays = {k.split(".", 1)[1] if k.startswith("kwargs.") else k: data[k]
                      for k in data.files}
    args = [v for _, v in sorted((int(k[5:]), arrays.pop(k)) for k in list(arrays)
                                 if k.startswith("args."))]
    times, out = [], None
    for _ in range(ns.repeat):
        t0 = time.perf_counter()
        out = (runner.generate(next(iter([*args, *arrays.values()]), None), ns.generate)
               if ns.generate else runner.run(args, arrays, timeout=ns.call_timeout))
        times.append(time.perf_counter() - t0)
    if out is not None and ns.output and runner.rank == 0:
        np.savez(ns.output, **({"ids": out} if ns.generate else flat_outputs(out)))
    entry = runner.plan["stages"][runner.rank]
    return {"rank": runner.rank, "world": runner.world, "layers": entry["layers"],
            "times": times, "compile_s": load_s, "weights_bytes": runner.weights_bytes,
            "rss_start_mib": rss_start, "rss_compiled_mib": rss_loaded,
            "rss_peak_mib": _rss_mib(), "threads": runner.threads_per_stage,
            "chunks": runner.plan["lengths"]}


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank; returns 0, or exits the process with status 1 on any error."""
    from tppc.processes.rank_exit import LAUNCH_DIR_ENV, cleanup, end_stopped_peers, guard_rank

    ns = _parser().parse_args(argv)
    rank = os.environ.get("RANK", "?")
    guard_rank()  # signals and the launcher's death end this rank, leaving nothing behind
    try:
        report = _run(ns)
    except BaseException as exc:  # never hang in teardown: report and leave at once
        print(f"[tppc.run rank {rank}] {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        stopped = end_stopped_peers()  # torchrun would wait 30 s for a stopped rank
        if stopped:
            print(f"[tppc.run rank {rank}] killed stopped rank process(es) {stopped} of "
                  "this job (SIGSTOP: they cannot act on torchrun's SIGTERM)",
                  file=sys.stderr, flush=True)
        cleanup()
        os._exit(1)
    if ns.report:
        if LAUNCH_DIR_ENV not in os.environ:  # a launcher's directory is never re-created
            Path(ns.report).mkdir(parents=True, exist_ok=True)
        if Path(ns.report).is_dir():
            Path(ns.report, f"rank{report['rank']}.json").write_text(json.dumps(report))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
