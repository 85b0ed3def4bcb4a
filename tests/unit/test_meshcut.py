"""Worker graphs on a stage mesh (issue 29): tppc's own DiT and GPT, every form and their
products, exact against the eager model; the refusals by name.

Each case runs every worker's parts in lockstep with the reference collectives
(:mod:`tests.unit.meshcut_oracle`) and compares the leader's outputs with the eager model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.oracles import assert_kernels_close
from tests.unit.meshcut_oracle import patch_feeds, run_mesh, staged
from tppc import examples
from tppc.errors import SpecError
from tppc.passes.meshcut.rows import interleave_parts, part_rows
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.passes.sharding.split_parts import split_parts
from tppc.program.mesh import Mesh


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.fixture(scope="module")
def dit():
    """The own DiT (4 heads, 4 patch rows) on 2 stages, a guided batch of 2."""
    model, _, kwargs = examples.dit(size=8, depth=2)
    torch.manual_seed(1)
    args = (torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0]))
    return staged(model, args, kwargs, num_stages=2)


@pytest.fixture(scope="module")
def gpt():
    """The own causal GPT on 2 stages, 2 chunks of 8 tokens, a batch of 2."""
    model, _, _ = examples.gpt(seq_len=16, n_layer=2)
    torch.manual_seed(1)
    return staged(model, (torch.randint(0, 256, (2, 16)),), num_stages=2, chunks=2)


DIT_MESHES = [Mesh(cfg=2), Mesh(ring=4), Mesh(ulysses=2), Mesh(ring=2, ulysses=2),
              Mesh(cfg=2, ulysses=2, tp=2)]  # ring=2 alone: test_mesh_programs.py


@pytest.mark.parametrize("mesh", DIT_MESHES, ids=lambda m: "x".join(map(str, m.degrees)))
def test_dit_every_form_and_product_is_exact(dit, mesh) -> None:
    assert_kernels_close(_first(run_mesh(dit, mesh)), dit.want)


@pytest.mark.parametrize("mesh", [Mesh(ulysses=2), Mesh(cfg=2, ring=2),
                                  Mesh(ring=2, ulysses=2)],
                         ids=lambda m: "x".join(map(str, m.degrees)))
def test_causal_chunks_with_sequence_parallelism_are_exact(gpt, mesh) -> None:
    """Two chunks, K/V buffers kept between them: each worker's sub-chunk sees the keys
    up to its queries' positions (Ulysses: up to the group's rows)."""
    assert_kernels_close(_first(run_mesh(gpt, mesh)), _first(gpt.want))


def test_llama_with_a_padding_mask_and_grouped_heads_is_exact() -> None:
    """GQA (4 query heads, 2 key/value heads), a key padding mask (the batch's second row
    padded), causal, 2 chunks on 2 stages: the mask's batch follows the cfg cut, Ulysses
    splits both head counts."""
    pytest.importorskip("transformers")
    model, _, _ = examples.hf_llama(seq_len=16)
    torch.manual_seed(1)
    ids, mask = torch.randint(0, 128, (2, 16)), torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    st2 = staged(model, (ids,), {"attention_mask": mask}, num_stages=2, chunks=2)
    want = st2.want.logits[mask.bool()]
    for mesh in (Mesh(ulysses=2), Mesh(cfg=2, ring=2)):
        assert_kernels_close(run_mesh(st2, mesh)[0][mask.bool()], want)


@pytest.mark.parametrize("mesh", [Mesh(ulysses=2), Mesh(cfg=2, ring=2)],
                         ids=lambda m: "x".join(map(str, m.degrees)))
def test_pipefusion_patches_with_sequence_parallelism_match_pipefusion_alone(dit, mesh):
    """Two patches of 2 patch rows, two steps on other latents: the second step's first
    patch reads the first step's (stale) K/V of the second patch. Each patch's exchange fills every worker's
    buffers with its fresh K/V, so the mesh equals PipeFusion on one worker per stage."""
    feeds = patch_feeds(dit, [0, 2, 4])
    before = [[{k: v * 0.5 if k == "x" else v for k, v in f.items()} for f in stage]
              for stage in feeds]  # the step before: other latents
    want = run_mesh(dit, Mesh(), before, feeds)[0]
    assert not torch.allclose(want, dit.want)  # stale K/V: not the warm result
    assert_kernels_close(run_mesh(dit, mesh, before, feeds)[0], want)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=st.sampled_from([1, 2]), ring=st.sampled_from([1, 2, 4]),
       ulysses=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]))
def test_random_dit_meshes_are_exact_or_refused_by_name(dit, cfg, ring, ulysses, tp) -> None:
    mesh = Mesh(cfg=cfg, ring=ring, ulysses=ulysses, tp=tp)
    if mesh.size > 8:
        return
    if ring * ulysses > 4:  # 4 patch rows
        with pytest.raises(SpecError, match="fix:"):
            run_mesh(dit, mesh)
        return
    assert_kernels_close(_first(run_mesh(dit, mesh)), dit.want)


def test_workers_meet_each_groups_collectives_in_the_same_order(dit) -> None:
    mesh = Mesh(cfg=2, ring=2, ulysses=2)
    joins = [split_parts(worker_graph(dit.graphs[1], mesh, r))[1] for r in range(mesh.size)]
    assert all(j == joins[0] for j in joins)
    groups = [j.group for j in joins[0]]
    assert {"ulysses", "ring", "cfg"} <= set(groups)
    assert groups[-3:] == ["ulysses", "ring", "cfg"]  # the last stage's gathers


def test_worker_graph_keeps_the_stage_inputs_and_cuts_its_buffers(dit) -> None:
    stage = dit.graphs[0]
    gm = worker_graph(stage, Mesh(cfg=2, ulysses=2), 3)
    names = [p.name for p in stage.graph.find_nodes(op="placeholder")]
    assert [p.name for p in gm.graph.find_nodes(op="placeholder")] == names
    shapes = {p.name: p.meta["tppc.chunk_input"].shape for p in gm.graph.find_nodes(
        op="placeholder") if p.meta["tppc.chunk_input"].kind == "key"}
    assert list(shapes.values()) == [(1, 2, None, 16)]  # batch 2 / cfg, 4 heads / ulysses


def test_batch_that_does_not_divide_is_refused_by_name(dit) -> None:
    with pytest.raises(SpecError, match=r"cfg_parallel=4 .* batch of 2 .* fix"):
        worker_graph(dit.graphs[0], Mesh(cfg=4), 0)


def test_heads_that_do_not_divide_are_refused_by_name(dit) -> None:
    with pytest.raises(SpecError, match=r"attention .* has 4 query heads per worker; "
                                        r"ulysses=8 .* fix"):
        worker_graph(dit.graphs[0], Mesh(ulysses=8), 0)


def test_chunk_that_does_not_divide_is_refused_by_name(dit) -> None:
    with pytest.raises(SpecError, match=r"chunk of 4 sequence units .* 3 equal parts .* fix"):
        run_mesh(dit, Mesh(ring=3))


class BatchMixBlock(nn.Module):
    """Bidirectional attention, then a correction by the batch's mean (mixes the guided
    halves: CFG cannot cut it, sequence parallelism can)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        h = x + self.out(a.transpose(1, 2).reshape(b, t, 8))
        return h - h.mean(dim=0, keepdim=True)


class BatchMix(nn.Module):
    """Two :class:`BatchMixBlock` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BatchMixBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_op_mixing_the_batch_refuses_cfg_by_name() -> None:
    torch.manual_seed(0)
    st2 = staged(BatchMix().eval(), (torch.randn(2, 16, 8),))
    with pytest.raises(SpecError, match=r"cfg_parallel=2 .* mean.* mixes batch elements: "
                                        r".*reduces over the cut axis. fix: cfg_parallel=1"):
        worker_graph(st2.graphs[0], Mesh(cfg=2), 0)
    assert_kernels_close(_first(run_mesh(st2, Mesh(ring=2))), st2.want)


def test_rows_of_video_frames_round_trip() -> None:
    x = torch.arange(24).view(1, 24, 1)
    parts = [part_rows(x, 1, p, 3, frames=2) for p in range(3)]
    assert parts[1][0, :, 0].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert torch.equal(interleave_parts(torch.cat(parts, 1), 1, 3, frames=2), x)
