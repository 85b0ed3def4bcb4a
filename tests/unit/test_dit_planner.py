"""The DiT hybrid planner: CFG x Ulysses x Ring x TP x PipeFusion chosen by price, on a
PixArt-shaped transformer captured on meta (6 heads, 1024 tokens, 8 blocks)."""

from __future__ import annotations

import pytest
import sympy
import torch

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.mesh_costs import (
    LayerTraffic,
    MeshExchanges,
    mesh_kv_bytes,
    ring_blocks,
)
from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.cost_models.roofline import node_time_terms
from tppc.driver.options import CompileOptions
from tppc.driver.planning import length_planner
from tppc.errors import PlanError, PlanInfeasible, SpecError
from tppc.planner import Plan, Workload
from tppc.planner.mesh_configurations import FixedDegrees, MeshLimits, mesh_configurations
from tppc.program.mesh import Mesh

WORKLOAD = Workload(kind="diffusion", steps=4, warmup_steps=1)
ROWS = 32  # 32 rows of 32 tokens


def _front(batch: int, heads: int = 6, head_dim: int = 64):
    from diffusers import PixArtTransformer2DModel

    from tppc.frontend.front_end import capture_front_end

    width = heads * head_dim
    with torch.device("meta"):
        model = PixArtTransformer2DModel(
            num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
            out_channels=8, num_layers=8, sample_size=64, patch_size=2,
            cross_attention_dim=width, caption_channels=64, norm_type="ada_norm_single",
            use_additional_conditions=False).eval()
        kwargs = {"encoder_hidden_states": torch.randn(batch, 16, 64),
                  "timestep": torch.tensor([10] * batch),
                  "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
                  "return_dict": False}
        args = (torch.randn(batch, 4, 64, 64),)
    return capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)


@pytest.fixture(scope="module")
def guided():
    return _front(2)


@pytest.fixture(scope="module")
def wide():
    """PixArt-XL's width (16 heads x 72), batch 1: enough work per layer for a GPU."""
    return _front(1, heads=16, head_dim=72)


def _plan(front, cluster: str, **options) -> Plan:
    opts = CompileOptions.from_kwargs(cluster=cluster, time_limit=2.0, **options)
    return length_planner(opts)(front, ROWS, workload=WORKLOAD)


def _fixed_latencies(front, cluster: str) -> dict[str, float]:
    """Every single-axis configuration of 2 devices, planned with its degrees fixed."""
    ones = {"num_stages": 1, "tensor_parallel": 1, "ulysses": 1, "ring": 1, "cfg_parallel": 1}
    return {name: _plan(front, cluster, **(ones | kw)).latency for name, kw in (
        ("pp2", {"num_stages": 2}), ("tp", {"tensor_parallel": 2}), ("ulysses", {"ulysses": 2}),
        ("ring", {"ring": 2}))}


def test_the_link_decides_the_mix(wide) -> None:
    chosen, fixed = {}, {}
    for cluster in ("2xh100-sxm", "2xh100-sxm@eth-100g"):
        plan = _plan(wide, cluster)
        fixed[cluster] = _fixed_latencies(wide, cluster)
        assert plan.latency <= min(fixed[cluster].values()) * (1 + 1e-6)  # the cheapest
        assert plan.lower_bound <= plan.latency
        assert all(plan.lower_bound <= v * (1 + 1e-9) for v in fixed[cluster].values())
        chosen[cluster] = plan.degrees
        assert plan.choice.runner_up and plan.choice.why  # the runner-up, and why it lost
        assert f"runner-up: {plan.choice.runner_up}" in plan.summary()
    fast, slow = chosen["2xh100-sxm"], chosen["2xh100-sxm@eth-100g"]
    # NVLink: one stage on a group exchanging per layer; Ethernet: PipeFusion's two stages,
    # one activation per patch and boundary
    assert fast["num_stages"] == 1 and slow["num_stages"] == 2
    assert fixed["2xh100-sxm@eth-100g"]["ulysses"] > fixed["2xh100-sxm"]["ulysses"]


def test_fixed_degrees_are_kept_and_recorded(guided) -> None:
    plan = _plan(guided, "4xh100-sxm", cfg_parallel=2, ulysses=2)
    assert plan.degrees["cfg_parallel"] == 2 and plan.degrees["ulysses"] == 2
    st = plan.stages[0]
    assert st.group_size == 4 and len(set(st.device_indices)) == 4
    assert "CFG2" in plan.summary() and "runner-up" not in plan.summary()
    patched = _plan(guided, "2xh100-sxm", num_stages=2, patches=4)
    assert len(patched.chunks) == 4 and patched.num_stages == 2


def test_a_memory_limit_makes_replicated_weights_infeasible(guided) -> None:
    need = _plan(guided, "2xh100-sxm", cfg_parallel=2).stages[0].memory_bytes
    split = _plan(guided, "2xh100-sxm", num_stages=2, cfg_parallel=1, ulysses=1, ring=1,
                  tensor_parallel=1)
    limit = max(st.memory_bytes for st in split.stages)
    assert limit < need  # stages hold half the weights each; CFG holds all of them
    with pytest.raises(PlanInfeasible, match="capacity"):
        _plan(guided, "2xh100-sxm", cfg_parallel=2, memory_limit=limit)
    plan = _plan(guided, "2xh100-sxm", memory_limit=limit)
    assert all(st.memory_bytes <= limit for st in plan.stages)
    assert plan.choice.infeasible  # the refused configurations say why


def test_mesh_plans_round_trip_through_json(guided) -> None:
    plan = _plan(guided, "4xh100-sxm", cfg_parallel=2, ring=2)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.degrees == plan.degrees


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"cfg_parallel": 0}, SpecError, "cfg_parallel=0"),
    ({"memory_limit": "lots"}, SpecError, "memory_limit='lots'"),
    ({"patches": 4, "chunks": 2}, SpecError, "patches=4"),
])
def test_bad_options_are_named(options, error, words) -> None:
    with pytest.raises(error, match=words):
        CompileOptions.from_kwargs(**options)


def test_refusals_name_the_model_limit(guided, wide) -> None:
    with pytest.raises(PlanError, match="head count"):
        _plan(guided, "4xh100-sxm", ulysses=4)
    with pytest.raises(PlanError, match="batch of 1"):
        _plan(wide, "2xh100-sxm", cfg_parallel=2)
    with pytest.raises(PlanError, match="need 8 devices"):
        _plan(guided, "4xh100-sxm", cfg_parallel=2, ulysses=2, num_stages=2)


def test_a_job_of_one_rank_per_device_gets_a_worker_on_every_device(guided) -> None:
    """``backend="distributed"``: the planner chooses the mix, each configuration with all
    its groups as stages (threads may leave devices idle, a job may not)."""
    limits = MeshLimits(heads=(6,), shard_sizes=(), batch=2, tokens=1024)
    configs, _ = mesh_configurations(Cluster.parse("4xh100-sxm"), limits,
                                     FixedDegrees(every_device=True))
    assert {c.label for c in configs} >= {"TP1", "CFG2 x TP1", "CFG2 x Ulysses2 x TP1"}
    assert all(c.fixed_stages * len(c.groups[0]) == 4 for c in configs)
    plan = _plan(guided, "2xh100-sxm", executor="distributed")
    assert sum(st.group_size for st in plan.stages) == 2
    assert plan.replicas == 1


def test_a_ring_is_priced_in_the_form_its_stale_patches_run(guided) -> None:
    """The form follows the patches, as ``tppc.pipefusion.denoise.patch_programs`` emits
    it: more than one patch a step runs a ring's attentions in the gather form (each
    worker's buffers hold the whole key length), one patch in the ring form (its own block,
    1/2) even with stale steps, as every step warm does."""
    ones = {"num_stages": 1, "tensor_parallel": 1, "ulysses": 1, "cfg_parallel": 1}
    warm_steps = Workload(kind="diffusion", steps=4, warmup_steps=4)

    def planned(**options) -> tuple[Plan, Plan]:
        opts = CompileOptions.from_kwargs(cluster="2xh100-sxm", time_limit=2.0, ring=2,
                                          **(ones | options))
        planner = length_planner(opts)
        return planner(guided, ROWS, workload=warm_steps), planner(guided, ROWS,
                                                                   workload=WORKLOAD)

    warm, stale = planned()  # one stage: the planner keeps one patch
    assert len(stale.chunks) == 1
    assert stale.stages[0].memory_bytes == warm.stages[0].memory_bytes
    assert not any("gather form" in w for w in stale.choice.collectives)
    assert any("ring shift" in w for w in stale.choice.collectives)
    _, patched = planned(patches=4)  # four patches: the gather form
    assert len(patched.chunks) == 4
    assert patched.stages[0].memory_bytes > warm.stages[0].memory_bytes
    assert all("gather form" in w for w in patched.choice.collectives)


def test_a_ring_plan_priced_in_one_form_has_the_patches_of_that_form(guided) -> None:
    """The planner chooses the patches: each plan's price is the form its patch count
    runs (one patch: the ring form; more: the gather form), whichever wins."""
    forms = set()
    for cluster in ("4xh100-sxm@eth-100g", "4xh100-sxm"):
        opts = CompileOptions.from_kwargs(cluster=cluster, time_limit=4.0, ring=2,
                                          num_stages=2, cfg_parallel=1, ulysses=1,
                                          tensor_parallel=1)
        plan = length_planner(opts)(guided, ROWS, workload=WORKLOAD)
        gather = [("gather form" in w) for w in plan.choice.collectives]
        assert gather and all(g == (len(plan.chunks) > 1) for g in gather), (cluster, plan)
        forms.add(gather[0])
    assert forms == {True, False}  # Ethernet: patches, gathered; NVLink: one, the ring


def test_placements_put_each_axis_on_the_links_searched() -> None:
    cluster = Cluster.parse("2x(2xh100-sxm)@ib-ndr")
    limits = MeshLimits(heads=(8,), shard_sizes=(), batch=2, tokens=1024)
    configs, _ = mesh_configurations(cluster, limits)
    cfg_uly = [c for c in configs if c.cfg_parallel == 2 and c.ulysses == 2]
    assert len(cfg_uly) == 2  # cfg across nodes, or ulysses across nodes
    mesh = Mesh(cfg=2, ulysses=2)
    spans = set()
    for c in cfg_uly:
        (group,) = c.groups
        cfg_pair = (group[0], group[mesh.members("cfg", 0)[1]])
        spans.add(cluster.nodes[cfg_pair[0]] != cluster.nodes[cfg_pair[1]])
    assert spans == {True, False}


def test_ulysses_pays_four_all_to_alls_per_self_attention() -> None:
    cluster = Cluster.parse("4xh100-sxm")
    traffic = LayerTraffic(self_attention=(1000,), cross_attention=(1000,))
    mesh = Mesh(ulysses=4)
    serial, passes = MeshExchanges(cluster, (0, 1, 2, 3), mesh, traffic).seconds(4096.0)
    one = collective_cost(cluster, "all_to_all", 1000 * 4096 / 4, (0, 1, 2, 3)).seconds
    assert serial == pytest.approx(6 * one) and passes == 0.0


def test_the_ring_shifts_its_own_block_serially_unless_overlapped() -> None:
    """Ring form over the whole sequence (4096 tokens): 3 shifts of a worker's own K/V block,
    the bytes a ring all-gather of the chunk moves; a patch (1024 of the 4096 tokens) and an
    attention in the gather form: the chunk's K/V gathered. A worker keeps a quarter of the
    ring form's K/V buffers."""
    cluster, group = Cluster.parse("4xh100-sxm"), (0, 1, 2, 3)
    traffic = LayerTraffic(self_attention=(1000,))
    shift = collective_cost(cluster, "ring_shift", 2 * 1000 * 4096 / 4, group).seconds
    gather = collective_cost(cluster, "all_gather", 2 * 1000 * 4096, group).seconds
    assert 3 * shift == pytest.approx(gather)

    def seconds(traffic: LayerTraffic, c: float, overlap: bool = False) -> tuple:
        return MeshExchanges(cluster, group, Mesh(ring=4), traffic, overlap=overlap,
                             seq_len=4096).seconds(c)

    assert seconds(traffic, 4096.0) == pytest.approx((3 * shift, 0.0))
    assert seconds(traffic, 4096.0, overlap=True) == pytest.approx((0.0, 3 * shift))
    patch = collective_cost(cluster, "all_gather", 2 * 1000 * 1024, group).seconds
    assert seconds(traffic, 1024.0) == pytest.approx((patch, 0.0))
    gathered = LayerTraffic(self_attention=(1000,), ring_form=(False,))
    assert seconds(gathered, 4096.0, overlap=True) == pytest.approx((gather, 0.0))
    assert mesh_kv_bytes(4000, traffic, Mesh(ring=4)) == 1000
    assert mesh_kv_bytes(4000, gathered, Mesh(ring=4)) == 4000


@pytest.mark.parametrize(("dtype", "cast_bytes", "launches"), [("bf16", 6, 5), ("fp32", 0, 4)])
def test_a_ring_pays_one_merge_of_partials_per_extra_block(dtype, cast_bytes, launches) -> None:
    """Ring-4 over a self-attention of 24 heads x 1152 queries x 128: 4 block kernels of a
    quarter of the keys and 3 merges of the float32 partial outputs (the block's output cast,
    then 3 float32 passes: the lerp), priced even where elementwise ops fuse (the merge runs
    between the ring's communication ops)."""
    attention = NodeCost("attn", "chunk_attention", "attention", sympy.Integer(10**9),
                         ((24, 1152, 4608, 128), (24, 1152, 128, 4608)), sympy.Integer(0),
                         sympy.Integer(10**7), dtype)
    (block, kernels), (merge, merges) = ring_blocks(attention, Mesh(ring=4))
    assert (kernels, merges) == (4, 3)
    assert block.matmuls == ((24, 1152, 1152, 128), (24, 1152, 128, 1152))
    values = 24 * 1152 * 128
    assert merge.bytes == values * (cast_bytes + 12) and merge.launches == launches
    h100 = DEVICE_PRESETS["h100-sxm"]
    fused = node_time_terms(merge, h100, fuse_elementwise=True)
    assert float(fused.total()) == pytest.approx(float(node_time_terms(merge, h100).total()))
    assert float(fused.total()) > values * 12 / h100.memory.achieved
    assert ring_blocks(attention, Mesh(ulysses=4)) == [(attention, 1)]


def test_meshes_the_graph_cannot_cut_are_refused_by_the_planner() -> None:
    from diffusers import SanaTransformer2DModel

    from tppc.frontend.front_end import capture_front_end

    with torch.device("meta"):  # linear attention: running sums over the tokens
        sana = SanaTransformer2DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
            cross_attention_dim=16, caption_channels=16, mlp_ratio=2.0, sample_size=8,
            patch_size=1).eval()
        kwargs = {"encoder_hidden_states": torch.randn(1, 6, 16),
                  "timestep": torch.tensor([10.0]), "return_dict": False}
        front = capture_front_end(sana, (torch.randn(1, 4, 8, 8),), kwargs, seq_dims=None,
                                  plan_only=True)
    mixing = "another kind of token mixing"  # the token cut's own reason
    opts = CompileOptions.from_kwargs(cluster="2xh100-sxm", time_limit=2.0, ulysses=2)
    with pytest.raises(PlanError, match=mixing):
        length_planner(opts)(front, 8, workload=WORKLOAD)
    free = length_planner(CompileOptions(cluster="2xh100-sxm", time_limit=2.0))(
        front, 8, workload=WORKLOAD)
    assert free.degrees["ulysses"] == free.degrees["ring"] == 1
    assert any(mixing in line for line in free.choice.infeasible)
