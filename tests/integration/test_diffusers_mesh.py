"""The drop-in with the transformer's stages on a mesh of workers: an unchanged guided
``PixArtAlphaPipeline`` call (a batch of two) with ``cfg_parallel=2`` equals the eager call
when every step is warm (stale patches on a mesh: ``tests/unit/test_mesh_programs.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("tokenizers")

import tppc.diffusers
from tests.integration.test_diffusers_dropin import _call, pixart_pipe
from tests.oracles import assert_kernels_close


@pytest.fixture(scope="module")
def pixart() -> tuple:
    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    return pipe, call, _call(pipe, call)


def test_a_guided_pipeline_call_with_cfg_parallel_equals_eager_every_step_warm(pixart
                                                                             ) -> None:
    pipe, call, want = pixart
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, num_stages=1, executor="threads",
                                    threads_per_stage=1, cfg_parallel=2)
    assert_kernels_close(_call(pipe, call), want, depth=3)
    (cp,) = pipe.transformer.compiled.values()
    assert [w.rank for w in cp.program(cp.plan.seq_len).workers] == [0, 1]


def test_the_drop_in_picks_intra_op_by_price_and_equals_eager_every_step_warm(
        pixart, monkeypatch, tmp_path) -> None:
    """No degree given: under a pin whose 2-thread rates are 10x the 1-thread ones the
    planner picks one worker of 2 intra-op threads over CFG-2, Ulysses-2, Ring-2 and
    PipeFusion (``tests/unit/test_dit_intra_op.py`` prices both ways)."""
    from tests.unit.test_intra_op import _pin

    pipe, call, want = pixart
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 10.0)))
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, executor="threads", verify=False,
                                    time_limit=2.0)  # checked against eager below
    assert_kernels_close(_call(pipe, call), want, depth=3)
    (cp,) = pipe.transformer.compiled.values()
    plan = cp.denoise_plan(3, 3)  # the loop's plan (cached by its first call)
    assert plan.degrees["intra_op"] == 2 and plan.stages[0].device_indices == (0, 1)
