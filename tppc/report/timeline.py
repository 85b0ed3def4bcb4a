"""Gantt charts of a plan: stages × time, chunk jobs, link transfers, bubbles, lower bound.

One row per stage: the predicted jobs as filled bars labelled with their chunk, the link
transfer of each chunk to the next stage as a thin bar below, idle time (bubbles) shaded, the
lower bound as a dashed line. With ``measured`` (a :class:`tppc.pipeline.profile.Profile`),
the measured jobs are drawn as outlined bars on top of the prediction. Needs matplotlib (the
``viz`` extra).

Example:
    >>> plan_timeline(plan, "plan.png")                                # doctest: +SKIP
    >>> plan_timeline(plan, "run.png", measured=cp.profile(ids))
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tppc.errors import SpecError
from tppc.planner.plan import Plan

__all__ = ["draw_timeline"]


def draw_timeline(plan: Plan, path: str | Path, *, measured: Any = None) -> Path:
    """Draw a Gantt chart of stages × time into ``path`` (a PNG; needs matplotlib): chunk
    jobs, link transfers, bubbles, the lower bound, and ``measured`` (a
    :class:`tppc.pipeline.profile.Profile`) overlaid. Returns the path (``tppc.plan_timeline``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SpecError("tppc.plan_timeline() needs matplotlib. fix: pip install 'tppc[viz]'") from exc
    stages = plan.num_stages
    offset = plan.warmup_seconds
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.8 * stages))
    colors = plt.get_cmap("tab20").colors
    end = 0.0
    for st in plan.stages:
        s = st.index
        spans = sorted((plan.start[s][j] - offset, plan.end[s][j] - offset, j)
                       for j in range(len(plan.start[s])))
        for a, b, j in spans:
            ax.barh(s, (b - a) * 1e3, left=a * 1e3, height=0.6, color=colors[j % 20],
                    edgecolor="none")
            if (b - a) > 0.04 * max(plan.latency, 1e-12):
                ax.text((a + b) / 2 * 1e3, s, str(j), ha="center", va="center", fontsize=7)
            end = max(end, b)
        starts = _next_starts(plan, s)
        for _, b, j in spans:
            nxt = starts[j]
            if nxt is not None and nxt > b:  # the link transfer to the next stage
                ax.barh(s + 0.38, (nxt - b) * 1e3, left=b * 1e3, height=0.1, color="0.4")
        gaps = [(b, c) for (_, b, _), (c, _, _) in itertools.pairwise(spans) if c > b]
        for b, c in gaps:
            ax.barh(s, (c - b) * 1e3, left=b * 1e3, height=0.6, color="0.9", hatch="//",
                    edgecolor="0.7")
    if measured is not None:
        for job in measured.jobs:
            ax.barh(job.stage, (job.measured_end - job.measured_start) * 1e3,
                    left=job.measured_start * 1e3, height=0.3, fill=False, edgecolor="black",
                    linewidth=0.8)
            end = max(end, job.measured_end)
    if plan.lower_bound > 0:
        ax.axvline(plan.lower_bound * 1e3, linestyle="--", color="red",
                   label=f"lower bound {plan.lower_bound * 1e3:.2f} ms")
    ax.set_yticks(range(stages), [f"stage {st.index}\n{st.devices_label}" for st in plan.stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms" + (" (outlined: measured)" if measured is not None else ""))
    ax.set_xlim(0, end * 1e3 * 1.02 if end > 0 else 1)
    ax.set_title(f"{plan.seq_len} {plan.unit}, {len(plan.chunks)} chunks, {stages} stages: "
                 f"predicted {plan.latency * 1e3:.2f} ms")
    if plan.lower_bound > 0:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _next_starts(plan: Plan, s: int) -> list[float | None]:
    """Start of each chunk on stage ``s + 1`` (None on the last stage), in chunk order."""
    jobs = len(plan.start[s])
    if s + 1 >= plan.num_stages:
        return [None] * jobs
    return [plan.start[s + 1][j] - plan.warmup_seconds for j in range(jobs)]
