"""``tppc.export`` runs the artifact with ONNX Runtime on the compile's example and compares it
with the torch program, the captured graph and the eager model. The oracle: an ONNX stage whose
output is changed on purpose (the error must name that stage and that output), and the eager
model (an unchanged export passes).
"""

from __future__ import annotations

import numpy as np
import pytest

import tppc
from tppc.backends.onnxruntime import OrtStage
from tppc.examples import gpt


@pytest.fixture(scope="module")
def compiled():
    model, args, kwargs = gpt(seq_len=24, n_layer=2)
    return tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=3)


def _scale_stage_output(monkeypatch, stage: int, factor: float) -> None:
    """ONNX stage ``stage`` returns its first output times ``factor`` (a mistranslation)."""
    step = OrtStage.step

    def broken(self, call, start, end, boundary):
        out = step(self, call, start, end, boundary)
        if self.index == stage:
            out = [np.asarray(out[0]) * np.float32(factor), *out[1:]]
        return out

    monkeypatch.setattr(OrtStage, "step", broken)


def test_an_export_is_checked_against_the_torch_program_and_the_eager_model(compiled,
                                                                              tmp_path) -> None:
    lines: list[str] = []
    tppc.export(compiled, tmp_path, progress=lines.append)
    assert any("export validated" in line and "eager model compared" in line for line in lines)


@pytest.mark.parametrize(("stage", "output"), [(0, "boundary."), (1, "output")])
def test_a_stage_whose_onnx_output_differs_is_named(compiled, tmp_path, monkeypatch, stage,
                                                     output) -> None:
    _scale_stage_output(monkeypatch, stage, 1.5)
    with pytest.raises(tppc.SoundnessError) as info:
        tppc.export(compiled, tmp_path)
    err = info.value
    assert err.stage == stage and err.output.startswith(output)
    assert f"ONNX stage {stage}" in str(err) and "verify=False" in str(err)
    assert err.max_diff > 1e-3


def test_verify_false_skips_the_export_check(compiled, tmp_path, monkeypatch) -> None:
    _scale_stage_output(monkeypatch, 0, 1.5)
    tppc.export(compiled, tmp_path, verify=False)
    runner = tppc.load(tmp_path)  # the unchecked artifact is wrong: what the check is for
    ids = compiled.example[0][0]
    want = compiled(ids).detach().numpy()
    assert np.abs(runner(ids.numpy()) - want).max() > 1e-2


def test_a_long_example_is_checked_at_a_short_length(tmp_path, monkeypatch) -> None:
    model, args, kwargs = gpt(seq_len=300, n_layer=2)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2)
    lines: list[str] = []
    tppc.export(cp, tmp_path, progress=lines.append)
    assert any("length 64" in line for line in lines)
    _scale_stage_output(monkeypatch, 0, 1.5)
    with pytest.raises(tppc.SoundnessError, match="ONNX stage 0"):
        tppc.export(cp, tmp_path)


def _nudge_model_output(monkeypatch, relative: float) -> None:
    """The last ONNX stage's first output moved by ``relative · max(1, max |value|)`` on one
    entry (ONNX Runtime's kernels summing in another order, or a small mistranslation)."""
    step = OrtStage.step

    def nudged(self, call, start, end, boundary):
        out = step(self, call, start, end, boundary)
        if self.index == 1 and start == 0:
            value = np.array(out[0], copy=True)
            value.flat[0] += np.float32(relative * max(1.0, float(np.abs(value).max())))
            out = [value, *out[1:]]
        return out

    monkeypatch.setattr(OrtStage, "step", nudged)


def test_the_check_accepts_kernel_rounding_relative_to_the_values(compiled, tmp_path,
                                                                  monkeypatch) -> None:
    """1.5e-4 of the largest value (Flux's export missed the old fixed 1e-4 by a hair) is
    kernel rounding: accepted (2048 ulps of float32, 2.4e-4); 1e-3 is not."""
    _nudge_model_output(monkeypatch, 1.5e-4)
    tppc.export(compiled, tmp_path)
    _nudge_model_output(monkeypatch, 1e-3)
    with pytest.raises(tppc.SoundnessError, match="ONNX stage 1"):
        tppc.export(compiled, tmp_path)


def _break_at_other_lengths(monkeypatch, length: int, crash: bool) -> None:
    """ONNX stage 0 is right at ``length`` only (a size of the example baked into its graph):
    elsewhere its first output is scaled by 1.5, or ONNX Runtime raises."""
    step = OrtStage.step

    def broken(self, call, start, end, boundary):
        out = step(self, call, start, end, boundary)
        if self.index == 0 and call.seq_len != length:
            if crash:
                raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid "
                                   "dimensions for input")
            out = [np.asarray(out[0]) * np.float32(1.5), *out[1:]]
        return out

    monkeypatch.setattr(OrtStage, "step", broken)


@pytest.mark.parametrize("crash", [False, True])
def test_an_artifact_right_at_the_example_length_only_is_refused(compiled, tmp_path,
                                                                 monkeypatch, crash) -> None:
    lines: list[str] = []
    tppc.export(compiled, tmp_path, progress=lines.append)
    assert any("length 24, 3 chunk(s) and length 23" in line for line in lines), lines
    _break_at_other_lengths(monkeypatch, 24, crash)
    what = r"is right at length 24 and fails at length 23" if crash else \
        r"ONNX stage 0, chunk \[0, \d+\) of length 23"
    with pytest.raises(tppc.SoundnessError, match=what):
        tppc.export(compiled, tmp_path)


def test_a_recorded_length_is_checked_with_its_exported_chunks(compiled, tmp_path,
                                                               monkeypatch) -> None:
    lines: list[str] = []
    tppc.export(compiled, tmp_path, lengths=[24, 40], progress=lines.append)
    assert any("and length 40" in line for line in lines), lines
    chunks = tppc.load(tmp_path).chunks(40)
    _break_at_other_lengths(monkeypatch, 24, False)
    with pytest.raises(tppc.SoundnessError,
                       match=rf"chunk \[0, {chunks[0][1]}\) of length 40"):
        tppc.export(compiled, tmp_path, lengths=[24, 40])
