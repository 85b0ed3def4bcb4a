"""An intra-op plan exported and loaded: one ONNX graph for the stage, run by ONNX Runtime.

The plan is forced (``intra_op=2``) under a synthetic pin with a 2-thread entry, so nothing
here depends on this machine's speed.
"""

from __future__ import annotations

import torch

import tppc
from tests.oracles import assert_kernels_close
from tests.unit.test_intra_op import _pin
from tppc.examples.hf import hf_llama
from tppc.program.cores import cores_per_device


def test_an_intra_op_plan_exports_and_loads_equal_to_eager(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 0.3)))
    model, (ids,), _ = hf_llama(seq_len=32, layers=2)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", intra_op=2, executor="threads")
    assert cp.plan.degrees["intra_op"] == 2
    out = tmp_path / "artifact"
    tppc.export(cp, out)  # validated against the torch program and the eager model
    loaded = tppc.load(out)
    assert len(loaded.plan["stages"]) == 1  # one graph: the worker of both devices
    assert loaded.threads_per_stage == 2 * cores_per_device(2)  # its k devices' cores
    with torch.no_grad():
        want = model(ids).logits
    assert_kernels_close(loaded(ids).logits, want)
