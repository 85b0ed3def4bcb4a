"""Export to ONNX and the ONNX Runtime runner: outputs equal the torch backend's (fp32)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

import tppc
from tppc.artifact.core.load import SCHEMA, sha256_file
from tppc.artifact.writer.graphs import export_stage_graph, split_attention
from tppc.examples import gpt
from tppc.ir.ops import chunk_attention_eager


@pytest.fixture(scope="module")
def compiled():
    model, args, kwargs = gpt(seq_len=64)
    return model, args, tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2,
                                     chunks=3)


@pytest.fixture(scope="module")
def artifact(compiled, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt")
    tppc.export(compiled[2], path, lengths=[40, 64])
    return path


@pytest.mark.parametrize("causal,gqa", [(True, False), (True, True), (False, False)])
def test_split_attention_equals_chunk_attention_over_the_written_buffer(causal, gqa) -> None:
    torch.manual_seed(0)
    heads, kv_heads = (4, 2) if gqa else (2, 2)
    start, c, cap = 5, 4, 12
    kv_len = start + c if causal else cap
    query = torch.randn(1, heads, c, 8)
    kb, vb = torch.randn(1, kv_heads, cap, 8), torch.randn(1, kv_heads, cap, 8)
    k, v = torch.randn(1, kv_heads, c, 8), torch.randn(1, kv_heads, c, 8)
    ours = split_attention(query, kb, vb, k, v, start, kv_len, causal, None, gqa)
    kb[:, :, start:start + c], vb[:, :, start:start + c] = k, v  # what the torch stage does
    want = chunk_attention_eager(query, kb[:, :, :kv_len], vb[:, :, :kv_len], start, causal,
                                 None, gqa)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)


def test_export_stage_graph_returns_the_rows_the_torch_stage_writes(compiled) -> None:
    cp = compiled[2]
    stage = cp.program(64).stages[1]
    gm, kv_names = export_stage_graph(stage)
    assert kv_names == tuple(f"kv.{b.name}" for b in stage.buffers)
    assert not any(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes)
    torch.manual_seed(1)
    x = torch.randn(1, 10, 64)
    buffers = {b.name: torch.randn([30 if s is None else s for s in b.shape])
               for b in stage.buffers}
    feeds = {"chunk_start": 7, "chunk_size": 10}
    args = [x if n not in feeds and n not in buffers else feeds.get(n, buffers.get(n))
            for n, _ in stage.inputs]
    exported = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    with torch.no_grad():
        want = stage.module(*args)  # writes rows [7, 17) of the buffers in place
    torch.testing.assert_close(exported[0], want[0], atol=1e-5, rtol=1e-5)
    for b, rows in zip(stage.buffers, exported[1:]):
        torch.testing.assert_close(rows, buffers[b.name][:, :, 7:17])


def test_loaded_runner_equals_the_torch_backend_at_every_exported_length(compiled,
                                                                          artifact) -> None:
    model, _, cp = compiled
    runner = tppc.load(artifact, threads_per_stage=1)
    assert runner.lengths == (40, 64)
    for length in (40, 64):
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = model(ids).numpy()
        np.testing.assert_allclose(runner(ids.numpy()), want, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(runner(ids.numpy()), cp(ids).numpy(), atol=1e-4, rtol=1e-4)


def test_plan_json_records_schema_chunks_wiring_signature_and_hashes(compiled,
                                                                      artifact) -> None:
    cp = compiled[2]
    doc = json.loads((artifact / "plan.json").read_text())
    assert doc["schema"] == SCHEMA and doc["tppc_version"] == tppc.__version__
    assert doc["lengths"]["64"] == [list(c) for c in cp.program(64).chunks]
    assert [s["layers"] for s in doc["stages"]] == [list(st.layers) for st in cp.stages]
    first, last = doc["stages"]
    assert first["boundary_out"] == last["boundary_in"] != []
    assert [i["kind"] for i in last["inputs"]][:3] == ["boundary", "chunk_start", "chunk_size"]
    assert {b["output"] for b in last["buffers"]} <= set(
        o.name for o in onnx.load(artifact / last["file"]).graph.output)
    assert doc["signature"]["inputs"] == [{"name": "input_ids", "dtype": "int64",
                                           "shape": [1, None], "seq_axes": [1],
                                           "seq_rows": [1]}]
    for name, meta in doc["files"].items():
        assert meta == {"sha256": sha256_file(artifact / name),
                        "size": (artifact / name).stat().st_size}


def test_each_stage_file_holds_only_that_stages_weights(compiled, artifact) -> None:
    doc = json.loads((artifact / "plan.json").read_text())
    for entry, stage in zip(doc["stages"], compiled[2].program(64).stages):
        files = {entry["file"]: ""}
        if entry["positional_file"]:  # names relative to the positional program
            files[entry["positional_file"]] = "tppc_positional."
        inits = [(prefix + i.name, i) for f, prefix in files.items()
                 for i in onnx.load(artifact / f).graph.initializer
                 if not i.name.startswith("_t")]  # weights, not the graph's small constants
        params = dict(stage.module.named_parameters())
        assert {n for n, _ in inits} <= set(params) | {
            n for n, _ in stage.module.named_buffers()}
        assert sum(int(np.prod(i.dims)) for n, i in inits if n in params) \
            == stage.param_count


def test_buffers_are_only_sliced_never_copied_whole(artifact) -> None:
    doc = json.loads((artifact / "plan.json").read_text())
    for entry in doc["stages"]:
        graph = onnx.load(artifact / entry["file"]).graph
        buffers = {b["name"] for b in entry["buffers"]}
        readers = {n.op_type for n in graph.node if set(n.input) & buffers}
        assert readers == {"Slice"}  # the prefix [0, chunk_start); no Concat/ScatterND
        kv_outputs = [o for o in graph.output if o.name.startswith("kv.")]
        assert len(kv_outputs) == len(buffers)


def test_weights_in_external_data_load_and_run(compiled, tmp_path) -> None:
    model, args, cp = compiled
    tppc.export(cp, tmp_path, external_data=True)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert all(f"{s['file']}.data" in s["files"] for s in doc["stages"])
    with torch.no_grad():
        want = model(*args).numpy()
    np.testing.assert_allclose(tppc.load(tmp_path)(args[0].numpy()), want, atol=1e-4,
                               rtol=1e-4)


def test_torch_tensors_are_accepted_as_inputs(compiled, artifact) -> None:
    model, args, _ = compiled
    with torch.no_grad():
        want = model(*args).numpy()
    np.testing.assert_allclose(tppc.load(artifact)(input_ids=args[0]), want, atol=1e-4,
                               rtol=1e-4)
