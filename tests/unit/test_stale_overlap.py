"""A denoising run whose stale steps overlap nothing says so (issue 30): one patch (every step
the whole latent: the warm loop's result) or one pipeline stage (the patches follow each other:
no faster, and approximate). A :class:`StalePatchWarning` names why and the fix; a run that
pipelines, or one with every step warm, is quiet."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import tppc
from tppc import examples
from tppc.pipefusion.denoise import choose_patches
from tppc.pipefusion.quality import StalePatchWarning

diffusers = pytest.importorskip("diffusers")


def _stub(stages: int):
    """A compiled pipeline whose program's plan has ``stages`` stages (choose_patches reads
    nothing else when ``patches`` is given)."""
    plan = types.SimpleNamespace(stages=(None,) * stages)
    return types.SimpleNamespace(program=lambda length, front: types.SimpleNamespace(plan=plan))


@pytest.mark.parametrize("stages,patches,steps,warmup,text", [
    (2, 1, 4, 1, r"PipeFusion: 3 stale step\(s\) overlap nothing: one patch \(the 8 patch rows "
                 r"as one chunk\): each of them runs the whole latent, the warm loop's result "
                 r"and time\. fix: patches >= 2 on a plan of 2 or more stages, or "
                 r"warmup_steps=None"),
    (1, 4, 4, 2, r"PipeFusion: 2 stale step\(s\) overlap nothing: the plan has one stage: its 4 "
                 r"patches run one after another there, no faster than the warm loop, and their "
                 r"stale K/V make the result differ from it\. fix: compile with num_stages >= 2"),
])
def test_a_run_that_cannot_overlap_warns_naming_why(stages, patches, steps, warmup,
                                                    text) -> None:
    with pytest.warns(StalePatchWarning, match=text):
        choose_patches(_stub(stages), None, 8, steps, warmup, patches)


@pytest.mark.parametrize("stages,patches,warmup", [(2, 2, 1), (1, 4, 4), (2, 1, 9)])
def test_a_pipelined_or_warm_run_is_quiet(stages, patches, warmup) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", StalePatchWarning)
        _, bounds = choose_patches(_stub(stages), None, 8, 4, warmup, patches)
    assert len(bounds) == patches + 1


def test_one_stage_denoising_warns_and_its_one_patch_run_is_the_warm_loop() -> None:
    """The claims of both warnings, on a one-stage DiT: one patch equals every step warm bit
    for bit; two patches on the one stage differ from it (stale K/V, nothing overlapped)."""
    torch.set_num_threads(1)
    model, (x, t, labels), kwargs = examples.dit(size=8, depth=2)
    cp = tppc.compile(model, (x, t, labels), kwargs, executor="local", num_stages=1,
                      verify=False)  # the oracle is the same pipeline's warm loop

    def run(**kw) -> torch.Tensor:
        return cp.denoise(x, diffusers.DDIMScheduler(), 3, model_kwargs={"y": labels},
                          timestep_arg="t", **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("error", StalePatchWarning)
        warm = run(warmup_steps=None)
    with pytest.warns(StalePatchWarning, match=r"2 stale step\(s\) overlap nothing: one patch"):
        assert torch.equal(run(warmup_steps=1, patches=1), warm)
    with pytest.warns(StalePatchWarning, match=r"2 stale step\(s\) overlap nothing: the plan has "
                                               r"one stage: its 2 patches"):
        assert not torch.equal(run(warmup_steps=1, patches=2), warm)
