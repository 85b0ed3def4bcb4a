"""Tensor parallelism on the captured graph: the analysis, the shards, exactness.

Each model here is a form of its own (not one of the families of the integration tests):
a fused QKV with unequal GQA pieces and biases, a fused gate/up, a norm over a whole
projection, an odd head count. Every sharded run is compared with the eager model under the
kernel tolerance (a row-parallel linear sums its partial products in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tppc
from tests.oracles import assert_kernels_close
from tppc.driver.emit import build_program
from tppc.errors import ScheduleError, SpecError
from tppc.ir.records import SHARD, SHARD_SIZES
from tppc.program.actions import Action
from tppc.program.dry_run import check_actions

VOCAB, HIDDEN, HEADS, KV, HD = 96, 48, 4, 2, 12


class FusedBlock(nn.Module):
    """One linear makes q, k and v (4 + 2 + 2 heads, with bias), one makes gate and up."""

    def __init__(self, norm_q: bool = False, heads: int = HEADS, kv: int = KV) -> None:
        super().__init__()
        self.heads, self.kv = heads, kv
        self.qkv = nn.Linear(HIDDEN, (heads + 2 * kv) * HD, bias=True)
        self.out = nn.Linear(heads * HD, HIDDEN, bias=True)
        self.gate_up = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=True)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q_norm = nn.LayerNorm(heads * HD) if norm_q else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * HD, self.kv * HD, self.kv * HD], dim=-1)
        if self.q_norm is not None:  # a norm over every head: q stays whole
            q = self.q_norm(q)
        q = q.view(b, s, self.heads, HD).transpose(1, 2)
        k = k.view(b, s, self.kv, HD).transpose(1, 2)
        v = v.view(b, s, self.kv, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, self.heads * HD))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.gelu(gate) * up)


class FusedLM(nn.Module):
    """Embedding, fused blocks, norm, an LM head with a bias."""

    def __init__(self, layers: int = 2, **block: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(FusedBlock(**block) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _sharded(model: nn.Module, ids: torch.Tensor, degrees: tuple[int, ...],
             executor: str = "threads") -> torch.Tensor:
    cp = tppc.compile(model, (ids,), cluster=f"{len(degrees)}xcpu", num_stages=len(degrees),
                      chunks=2, executor=executor, verify=False)
    front = cp._front
    program = build_program(front.chunk, front.ctx, cp.plan, degrees=degrees)
    assert len(program.workers) == sum(degrees)
    cp.programs.hold(front, program)
    return cp(ids)


@pytest.mark.parametrize(("degrees", "executor"), [((2,), "local"), ((2, 2), "threads"),
                                                    ((2, 1), "threads")])
def test_fused_qkv_gate_up_exact(degrees: tuple[int, ...], executor: str) -> None:
    model = FusedLM().eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        want = model(ids)
    assert_kernels_close(_sharded(model, ids, degrees, executor), want)


def test_fused_roles_and_sizes() -> None:
    model = FusedLM(layers=1).eval()
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 16)),), cluster="1xcpu",
                      verify=False)
    gm = cp._front.annotated
    kinds = {n.name: n.meta[SHARD].kind for n in gm.graph.nodes if SHARD in n.meta}
    linears = [n.name for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert [kinds[n] for n in linears] == ["column", "row", "column", "row", "gather"]
    # the fused pieces: q 4 heads, k/v 2 heads, the gate/up halves, the vocabulary
    assert {HEADS, KV, HEADS * HD, KV * HD, 2 * HIDDEN, VOCAB} <= set(gm.meta[SHARD_SIZES])


def test_norm_over_a_whole_projection_keeps_it_whole_and_exact() -> None:
    model = FusedLM(norm_q=True).eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    cp = tppc.compile(model, (ids,), cluster="1xcpu", verify=False)
    notes = dict(cp._front.annotated.meta["tppc.shard_notes"])
    assert any("normalises over the cut axis" in why for why in notes.values())
    kinds = [n.meta[SHARD].kind for n in cp._front.annotated.graph.nodes
             if n.target == torch.ops.aten.linear.default]
    assert kinds[:2] == ["replicated", "replicated"]  # the fused QKV and the projection
    with torch.no_grad():
        want = model(ids)
    assert_kernels_close(_sharded(model, ids, (2,)), want)


def test_degree_that_does_not_divide_is_refused_by_name() -> None:
    model = FusedLM(heads=3, kv=3).eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    with pytest.raises(SpecError, match=r"size 3 .* tensor_parallel=2 .* fix"):
        _sharded(model, ids, (2,))


class MQABlock(nn.Module):
    """Separate projections, one key/value head (multi-query attention), a plain MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, n * HD, bias=False) for n in (HEADS, 1, 1))
        self.o = nn.Linear(HEADS * HD, HIDDEN, bias=False)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HD).transpose(1, 2)
        k = self.k(x).view(b, s, 1, HD).transpose(1, 2)
        v = self.v(x).view(b, s, 1, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k.expand(b, HEADS, s, HD),
                                           v.expand(b, HEADS, s, HD), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, HEADS * HD))
        return x + self.down(F.relu(self.up(x)))


class MQALM(nn.Module):
    """Two multi-query blocks and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(MQABlock() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_mqa_keeps_its_one_key_value_head_whole_and_shards_the_queries() -> None:
    model = MQALM().eval()
    ids = torch.randint(0, VOCAB, (1, 16))
    cp = tppc.compile(model, (ids,), cluster="1xcpu", verify=False)
    kinds = [n.meta[SHARD].kind for n in cp._front.annotated.graph.nodes
             if n.target == torch.ops.aten.linear.default]
    assert kinds == ["column", "replicated", "replicated", "row", "column", "row"] * 2 + [
        "gather"]
    with torch.no_grad():
        want = model(ids)
    for degrees in ((2,), (4,)):
        assert_kernels_close(_sharded(model, ids, degrees), want)


class NormedLM(nn.Module):
    """Every linear's output is normalised over its features: nothing can be cut."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + F.layer_norm(block(x), (HIDDEN,))
        return F.log_softmax(self.head(x), dim=-1)


def test_a_stage_with_nothing_to_cut_runs_whole_on_every_worker() -> None:
    model, ids = NormedLM().eval(), torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        want = model(ids)
    cp = tppc.compile(model, (ids,), cluster="1xcpu", verify=False)
    front = cp._front
    program = build_program(front.chunk, front.ctx, cp.plan, degrees=(2,))
    assert [(w.rank, w.parts) for w in program.workers] == [(0, ()), (1, ())]
    cp.programs.hold(front, program)
    assert_kernels_close(cp(ids), want)
    from tppc.passes.sharding.shard_graph import shard_graph
    with pytest.raises(SpecError, match=r"nothing in it can be cut .*normalises over the cut"):
        shard_graph(program.stages[0].module, 0, 2, "stage 0")


def test_parts_run_in_order() -> None:
    stage = (Action(0, 0, 0, 2, part=1), Action(0, 0, 0, 2))
    with pytest.raises(ScheduleError, match="after part -1"):
        check_actions((stage,), stages=(0,))


def test_a_part_of_one_block_of_rows_is_a_view_and_other_parts_are_contiguous_copies() -> None:
    """``take``: rows of one segment share the model's storage (no second copy of the
    weights in process); columns, and pieces of several segments, are contiguous copies."""
    from tppc.passes.sharding.shard_graph import take

    w = torch.arange(48.0).reshape(8, 6)
    rows = take(w, 0, (8,), 1, 2)
    assert rows.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    torch.testing.assert_close(rows, w[4:], rtol=0, atol=0)
    cols = take(w, 1, (6,), 1, 2)
    assert cols.is_contiguous() and cols.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    torch.testing.assert_close(cols, w[:, 3:], rtol=0, atol=0)
    fused = take(w, 0, (4, 4), 1, 2)  # e.g. gate and up: rows 2-3 of each
    torch.testing.assert_close(fused, torch.cat([w[2:4], w[6:8]]), rtol=0, atol=0)
