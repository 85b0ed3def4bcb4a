"""The quality option of ``cp.denoise``: a PSNR target mapped to warm-up steps and a patch cap.

Terms:
    quality: what the caller asks of the stale-K/V approximation, against the serial loop
        (every step warm):
        ``"exact"``: every step warm, the serial loop's result (no pipelining of steps);
        ``"balanced"``: a PSNR target of :data:`BALANCED_DB`;
        ``"fast"``: the warm-up given, the planner's fastest patch count (``None``: the same);
        a number: the PSNR target in dB.
    measured row: PSNR of the final images against the serial loop at a warm-up count (out of
        :data:`MEASURED_STEPS`) and a patch count, the worse of DDIM on an epsilon model and
        flow-matching Euler on a rectified-flow model — the project's DiT trained on synthetic
        16×16 images (``benchmarks/stale_quality.py``; the table there, BENCHMARKS.md and
        ``docs/diffusion.md``).

A target picks the measured row that meets it with the fewest warm-up steps, and among those
the most patches such that every measured patch count up to it meets it too: the warm-up is
raised to that row's share of the steps (rounded up) and the patches are capped at its count
(the planner plans at most that many, ``Workload.max_patches``; more patches leave more of
the K/V stale). No row meets the target: every step warm. The table is one model family's
measurement: a guide for other models, not a guarantee (their adjacent steps may differ
more; re-measure with the benchmark on your model).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

from tppc.errors import SpecError

__all__ = ["BALANCED_DB", "MEASURED", "MEASURED_STEPS", "Measured", "QualityChoice",
           "StalePatchWarning", "quality_settings", "warn_no_overlap"]

MEASURED_STEPS = 20
"""Denoising steps of the measured rows."""

BALANCED_DB = 35.0
"""The PSNR target (dB) of ``quality="balanced"``."""


class Measured(NamedTuple):
    """One measured row: warm-up steps out of :data:`MEASURED_STEPS`, patches, PSNR (dB)."""

    warmup_steps: int
    patches: int
    psnr_db: float


MEASURED: tuple[Measured, ...] = (
    Measured(1, 2, 37.1), Measured(1, 4, 33.2), Measured(1, 8, 31.1),
    Measured(2, 2, 37.6), Measured(2, 4, 33.9), Measured(2, 8, 31.7),
    Measured(4, 2, 37.7), Measured(4, 4, 34.0), Measured(4, 8, 31.8),
)
"""The worse of the two schedulers' PSNR per (warm-up, patches), from
``benchmarks/stale_quality.py`` (20 steps, 2 stages)."""


class QualityChoice(NamedTuple):
    """What a quality option sets: the warm-up steps and the most patches (``None``: any)."""

    warmup_steps: int
    max_patches: int | None


def quality_settings(quality: Any, steps: int, warmup_steps: int,
                     patches: int | None = None) -> QualityChoice:
    """The warm-up steps and the patch cap of ``quality`` for ``steps`` steps.

    The warm-up is never lowered below ``warmup_steps``; ``None`` and ``"fast"`` leave it and
    cap nothing.

    >>> quality_settings("exact", 20, 1)
    QualityChoice(warmup_steps=20, max_patches=None)

    Raises:
        SpecError: an unknown quality, or ``patches`` above the cap, naming the fix.
    """
    if quality is None or quality == "fast":
        return QualityChoice(warmup_steps, None)
    if quality == "exact":
        return QualityChoice(steps, None)
    if quality == "balanced":
        target = BALANCED_DB
    elif isinstance(quality, int | float) and not isinstance(quality, bool) \
            and math.isfinite(quality):
        target = float(quality)
    else:
        raise SpecError(f"quality={quality!r}. fix: 'exact', 'balanced', 'fast', None, or a "
                        "PSNR target in dB (e.g. 35.0)")
    warm, cap = _row_for(target)
    if warm is None:
        return QualityChoice(steps, None)
    warm = max(warmup_steps, math.ceil(warm * steps / MEASURED_STEPS))
    if warm >= steps:
        return QualityChoice(steps, None)
    if patches is not None and patches > cap:
        raise SpecError(
            f"patches={patches} with quality={quality!r}: at most {cap} patches met "
            f"{target:g} dB in the measured table. fix: patches <= {cap}, patches=None, or a "
            "lower target")
    return QualityChoice(warm, cap)


def _row_for(target: float) -> tuple[int | None, int]:
    """The fewest measured warm-up steps meeting ``target`` and the patch cap there."""
    for warm in sorted({row.warmup_steps for row in MEASURED}):
        rows = sorted((r for r in MEASURED if r.warmup_steps == warm), key=lambda r: r.patches)
        cap = 0
        for row in rows:
            if row.psnr_db < target:
                break
            cap = row.patches
        if cap:
            return warm, cap
    return None, 0


class StalePatchWarning(UserWarning):
    """A denoising run with stale steps whose patches overlap nothing (:func:`warn_no_overlap`)."""


def warn_no_overlap(stages: int, patches: int, rows: int, stale_steps: int) -> None:
    """Warn (:class:`StalePatchWarning`) when ``stale_steps`` steps asked for stale patches
    but the run cannot overlap anything: one patch (each step is the whole latent, the warm
    loop's result and time), or one pipeline stage (the patches follow each other on it: no
    faster than the warm loop, and not equal to it). Every denoising executor plans its
    patches through :func:`tppc.pipefusion.denoise.choose_patches`, which calls this."""
    if stale_steps < 1:
        return
    if patches < 2:
        why = (f"one patch (the {rows} patch rows as one chunk): each of them runs the whole "
               "latent, the warm loop's result and time")
        fix = "patches >= 2 on a plan of 2 or more stages"
    elif stages < 2:
        why = (f"the plan has one stage: its {patches} patches run one after another there, "
               "no faster than the warm loop, and their stale K/V make the result differ "
               "from it")
        fix = "compile with num_stages >= 2 (a cluster of 2 or more devices)"
    else:
        return
    warnings.warn(f"PipeFusion: {stale_steps} stale step(s) overlap nothing: {why}. fix: "
                  f"{fix}, or warmup_steps=None (every step warm, the serial loop's result)",
                  StalePatchWarning, stacklevel=4)
