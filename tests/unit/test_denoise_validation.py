"""``cp.denoise`` checks its patches on the first call: one step with patches after a full
warm-up (no stale K/V) must equal the one-chunk warm-up program's output. The oracle: a patch
program broken on purpose (every chunk that does not start at row 0 is scaled in stage 0; the
one-chunk program is untouched) must be refused, and without the check it changes the latents.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tppc
from tests.oracles import two_stage_plan
from tppc import examples
from tppc.pipefusion import denoise as denoise_module

diffusers = pytest.importorskip("diffusers")


def _compile(verify: bool = True):
    model, args, kwargs = examples.dit(size=16, depth=2)
    plan = two_stage_plan(tppc.compile(model, args, kwargs, executor="local", verify=False))
    return args, tppc.compile(model, args, kwargs, executor="local", plan=plan, verify=verify)


def _denoise(cp, args, patches: int = 2) -> torch.Tensor:
    x, _, labels = args
    return cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=1, patches=patches,
                      model_kwargs={"y": labels}, timestep_arg="t")


class _OffByAPatch:
    """A stage runnable whose outputs are scaled for chunks after the first row."""

    def __init__(self, runnable, start_at: int) -> None:
        self.runnable, self.start_at = runnable, start_at

    def __call__(self, *args):
        out = self.runnable(*args)
        if args[self.start_at] > 0:
            out = tuple(o * 1.5 if isinstance(o, torch.Tensor) and o.is_floating_point()
                        else o for o in out)
        return out


def _break_patches(monkeypatch) -> None:
    """Stage 0 of every denoise program computes something else for a chunk that starts
    after row 0 (what a wrong positional offset does)."""
    hoist = denoise_module.hoist_constants

    def broken(stage):
        stage = hoist(stage)
        names = [spec.kind for _, spec in stage.inputs]
        if stage.index != 0 or "chunk_start" not in names:
            return stage
        return dataclasses.replace(stage, runnable=_OffByAPatch(stage.runnable,
                                                                names.index("chunk_start")))

    monkeypatch.setattr(denoise_module, "hoist_constants", broken)


def test_the_first_denoise_with_patches_is_checked_once_per_shape(monkeypatch) -> None:
    args, cp = _compile()
    calls = []
    check = denoise_module.check_patches
    monkeypatch.setattr(denoise_module, "check_patches",
                        lambda *a: calls.append(check(*a)) or calls[-1])
    _denoise(cp, args)
    _denoise(cp, args)  # the same shape: not checked again
    _denoise(cp, args, patches=4)  # another split: checked
    assert len(calls) == 3 and calls[0] is not None and calls[0] < 1e-4
    assert calls[1] is None and calls[2] is not None


def test_a_patch_program_that_differs_from_one_chunk_is_refused(monkeypatch) -> None:
    args, cp = _compile()
    _break_patches(monkeypatch)
    with pytest.raises(tppc.SoundnessError, match="denoise patch program"):
        _denoise(cp, args)


def test_verify_false_skips_the_denoise_check(monkeypatch) -> None:
    args, cp = _compile(verify=False)
    good = _denoise(cp, args)
    cp.__dict__.pop("_denoise_programs")  # rebuilt below with the fault
    _break_patches(monkeypatch)
    bad = _denoise(cp, args)  # the unchecked denoise is wrong: what the check is for
    assert (bad - good).abs().max() > 1e-2
