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
