"""Translation validation of ``cp.denoise``: one step with patches against one without.

Terms:
    patch program: the programs the pipelined steps of a denoising call run (the first patch's
        and, with joint attention, the later patches'), with hoisted constants.
    warm-up program: the one-chunk program of the warm-up steps.
    full warm-up: a one-chunk pass of the patch program fills every K/V buffer with this
        step's rows before its patches run, so no patch reads stale K/V; the patches must
        then give the warm-up program's output exactly (within the tolerance of
        :func:`tppc.validation.replay.tolerance`).

:func:`check_patches` runs on the first denoising call with two patches or more and pipelined
steps, per (batch shape, patch rows, patches, placement), on the first step's inputs: the
warm-up program in one chunk, and the patch program after a full warm-up. A difference raises
:class:`tppc.errors.SoundnessError` (localised like a compile's check,
:mod:`tppc.validation.localize`). Skipped with ``verify=False`` and on the meta device. It costs
three forwards of the model once per shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from tppc.program.program import Program
from tppc.validation.replay import Replay
from tppc.validation.validate import check_replay

__all__ = ["check_patches"]


def check_patches(cp: Any, front: Any, flat: Sequence[Any], length: int,
                  bounds: tuple[int, ...], programs: tuple[Program, Program, Program | None]
                  ) -> float | None:
    """Check the patch program against the warm-up program on one step (see the module).

    Args:
        cp: the compiled pipeline (its ``options.verify`` decides; the result is cached on it).
        front: the call's front end.
        flat: the first step's flat inputs.
        length: patch rows of the latent.
        bounds: the patch boundaries.
        programs: the warm-up, first-patch and later-patch programs.

    Returns:
        The max-abs difference, or None when nothing was checked (one patch, ``verify=False``,
        the meta device, or this shape was checked before).

    Raises:
        SoundnessError: the patches' output differs from the warm-up program's.
    """
    if not cp.options.verify or len(bounds) < 3:
        return None
    if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in flat):
        return None
    checked = cp.__dict__.setdefault("_denoise_checked", set())
    placement = tuple((st.layers, st.device) for st in programs[1].stages)
    key = (front.batch, length, bounds, placement)
    if key in checked:
        return None
    full, first, rest = programs
    with torch.no_grad():
        whole = Replay(full, None, flat, length, ((0, length),)).run(locate=False)
    label = (f"denoise patch program ({len(bounds) - 1} patches after a full warm-up, against "
             "the one-chunk warm-up program's output)")
    run = check_replay(front, label, first, rest, flat, length,
                       tuple(itertools.pairwise(bounds)), warmup=True, reference=whole)
    checked.add(key)
    return run.max_diff
