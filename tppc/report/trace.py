"""Chrome traces (``chrome://tracing`` / Perfetto JSON) of a plan's predicted schedule.

One row per stage, one slice per (step, chunk) job with its token range; a warm-up slice
precedes diffusion plans that have synchronous warm-up steps.

Example:
    >>> trace = plan_trace(plan)                                    # doctest: +SKIP
    >>> json.dump(trace, open("plan.json", "w"))   # open in https://ui.perfetto.dev
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tppc.planner.plan import Plan

__all__ = ["plan_trace", "write_plan_trace"]


def plan_trace(plan: Plan) -> dict[str, Any]:
    """The predicted schedule of ``plan`` as a Chrome trace dict (times in microseconds)."""
    events: list[dict[str, Any]] = []
    chunks = plan.chunks
    for stage in plan.stages:
        s = stage.index
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": s,
                       "args": {"name": f"stage {s} ({stage.devices_label}, layers "
                                        f"[{stage.layer_start}, {stage.layer_end}))"}})
        if plan.warmup_seconds > 0:
            events.append(_slice(s, "warm-up", 0.0, plan.warmup_seconds, {}))
        for job, (begin, end) in enumerate(zip(plan.start[s], plan.end[s])):
            step, index = divmod(job, len(chunks))
            lo, hi = chunks[index]
            name = f"chunk {index} [{lo}, {hi})"
            if plan.workload.kind == "diffusion":
                name = f"step {step + plan.workload.warmup_steps} {name}"
            events.append(_slice(s, name, begin, end - begin,
                                 {"tokens": hi - lo, "prefix": lo, "step": step}))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"latency_s": plan.latency, "lower_bound_s": plan.lower_bound}}


def write_plan_trace(plan: Plan, path: str | Path) -> Path:
    """Write :func:`plan_trace` to ``path`` as JSON; returns the path."""
    out = Path(path)
    out.write_text(json.dumps(plan_trace(plan)))
    return out


def _slice(tid: int, name: str, start_s: float, dur_s: float, args: dict) -> dict[str, Any]:
    return {"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": start_s * 1e6,
            "dur": dur_s * 1e6, "args": args}
