"""ONNX translations of indexing and mixture-of-experts routing
(:mod:`tppc.artifact.writer.onnx_routing_ops`) against torch on the same inputs."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc.artifact.writer.graphs import ExportError
from tppc.artifact.writer.to_onnx import to_onnx

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_*


class _Router(torch.nn.Module):
    """transformers' ``grouped_mm`` experts on 4 experts, top-2, written out."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.up = torch.nn.Parameter(torch.randn(4, 8, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, 2)
        weights = weights / weights.sum(-1, keepdim=True)
        ids, perm = torch.sort(experts.reshape(-1))
        rows = x[perm // 2]
        counts = torch.histc(ids.float(), bins=4, min=0, max=3)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.up, offsets)
        inverse = torch.empty_like(perm).index_put((perm,), torch.arange(perm.shape[0]))
        mixed = (out[inverse].view(-1, 2, 6) * weights[..., None]).sum(1)
        return mixed, counts, torch.floor_divide(x, -0.7), (perm - 5) // 3


def _onnx_and_torch(model: torch.nn.Module, x: torch.Tensor):
    gm = torch.export.export(model, (x,)).module()
    for node in list(gm.graph.nodes):  # drop torch.export's input guards and dtype checks
        if node.op == "call_module" or "_assert" in str(node.target):
            gm.graph.erase_node(node)
    gm.recompile()
    session = ort.InferenceSession(to_onnx(gm, sym_name="chunk").SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x)
    return session.run(None, {session.get_inputs()[0].name: x.numpy()}), want


def test_grouped_experts_routing_translates_and_matches_torch() -> None:
    torch.manual_seed(0)
    got, want = _onnx_and_torch(_Router().eval(), torch.randn(7, 8))
    for ours, theirs in zip(got, want):
        if theirs.dtype.is_floating_point:
            assert_kernels_close(ours, theirs.numpy())
        else:  # negative ints: floor, not truncation
            assert (ours == theirs.numpy()).all()
    assert want[1].sum() == 14 and (want[1] > 0).sum() > 1  # every pair counted, experts vary


def test_index_tensors_on_the_leading_axes_translate_and_others_are_refused() -> None:
    """``x[i, j]`` (transformers' mask functions) is a GatherND; ``x[:, i, j]`` is refused."""
    class _Leading(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            i = torch.arange(x.shape[0])
            return x[i[:, None], i[None, :]]

    class _Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            i = torch.arange(x.shape[1])
            return x[:, i, i]

    (got,), want = _onnx_and_torch(_Leading(), torch.randn(3, 4, 2))
    assert (got == want.numpy()).all()
    with pytest.raises(ExportError, match=r"2 index tensors not all on the leading axes.*fix:"):
        _onnx_and_torch(_Inner(), torch.randn(2, 3, 3))
