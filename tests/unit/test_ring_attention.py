"""Ring attention (issue 29): the block kernels and their log-sum-exp merge against SDPA,
and the ring worker graph's shape: its own K/V block, ``ring - 1`` shifts per attention and
no gather of K/V; the gather form kept, with its reason, where the ring form does not apply.
The runs against the eager model are in ``test_meshcut*.py`` and ``test_mesh_programs.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.oracles import assert_kernels_close
from tests.unit.meshcut_oracle import run_mesh, staged
from tppc import examples
from tppc.ir.records import CHUNK_INPUT, RING_FORM
from tppc.passes.meshcut.ring_kernels import attend_block, finish, join_kv, step
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.passes.sharding.split_parts import split_parts
from tppc.program.mesh import Mesh
from tppc.program.program import BufferSpec


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_blocks_merged_by_their_log_sum_exps_equal_one_attention(kv_heads: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, kv_heads, 12, 8), torch.randn(2, kv_heads, 12, 8)
    gqa = kv_heads != 4
    out, lse = attend_block(q, k[:, :, :4], v[:, :, :4], 0.3, gqa)
    for a in (4, 8):  # the other two blocks, as received around a ring of 3
        out, lse = step(out, lse, q, join_kv(k[:, :, a:a + 4], v[:, :, a:a + 4]), 8, 0.3, gqa)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=gqa)
    assert_kernels_close(finish(out, q), want)
    math_out, _ = attend_block(q.double(), k.double(), v.double(), 0.3, gqa)  # not CPU flash
    assert_kernels_close(math_out.float(), want)


@pytest.fixture(scope="module")
def dit():
    """The own DiT (one block, 4 heads, 4 patch rows) as one stage, a guided batch of 2."""
    model, _, kwargs = examples.dit(size=8, depth=1)
    torch.manual_seed(1)
    args = (torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0]))
    return staged(model, args, kwargs)


def test_a_ring_worker_keeps_its_own_block_and_gathers_no_keys(dit) -> None:
    gm = worker_graph(dit.graphs[0], Mesh(ring=4), 1, output_rows=dit.signature.output_rows)
    joins = split_parts(gm)[1]
    forms = [n.meta[RING_FORM].form for n in gm.graph.nodes if RING_FORM in n.meta]
    assert forms == ["ring"]
    assert [j.kind for j in joins] == ["ring_shift"] * 3 + ["all_gather"]
    assert joins[-1].group == "ring"  # the last stage's output, not K/V
    specs = [p.meta[CHUNK_INPUT] for p in gm.graph.find_nodes(op="placeholder")
             if p.meta[CHUNK_INPUT].kind in ("key", "value")]
    assert {s.parts for s in specs} == {4}
    spec = BufferSpec("k", "key", "a", "l", 2, specs[0].shape, torch.float32,
                      scale=specs[0].scale, parts=4)
    assert spec.rows(4) == specs[0].scale and spec.nbytes(4) * 4 == \
        BufferSpec("k", "key", "a", "l", 2, specs[0].shape, torch.float32,
                   scale=specs[0].scale).nbytes(4)


def test_causal_attention_keeps_the_gather_form_with_its_reason() -> None:
    model, _, _ = examples.gpt(seq_len=16, n_layer=1)
    torch.manual_seed(1)
    st = staged(model, (torch.randint(0, 256, (1, 16)),), chunks=2)
    gm = worker_graph(st.graphs[0], Mesh(ring=2), 0)
    (form,) = [n.meta[RING_FORM] for n in gm.graph.nodes if RING_FORM in n.meta]
    assert form.form == "gather" and "causal" in form.reason
    assert "all_gather" in [j.kind for j in split_parts(gm)[1]]
    want = st.want if isinstance(st.want, torch.Tensor) else st.want[0]
    assert_kernels_close(run_mesh(st, Mesh(ring=2))[0], want)


def test_a_stage_told_to_gather_gathers(dit) -> None:
    gm = worker_graph(dit.graphs[0], Mesh(ring=2), 0, ring_gather="stale patches")
    assert {n.meta[RING_FORM].reason for n in gm.graph.nodes if RING_FORM in n.meta} == \
        {"stale patches"}
    assert "ring_shift" not in [j.kind for j in split_parts(gm)[1]]
