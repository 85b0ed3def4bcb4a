"""Cluster topology strings (nodes, inter-node links) and collective prices.

Expected times are computed by hand from the preset numbers: NVLink 4 370 GB/s and 8 µs,
NDR InfiniBand 50 GB/s and 10 µs, HDR 25 GB/s and 10 µs, NVLink 3 260 GB/s and 8 µs.
"""

from __future__ import annotations

import pytest

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.presets import DEVICE_PRESETS, LINK_PRESETS
from tppc.errors import SpecError

NVL4_BW, NVL4_LAT = 370e9, 8e-6
NDR_BW, IB_LAT = 50e9, 10e-6


def test_h20_preset_carries_its_datasheet_numbers():
    h20 = DEVICE_PRESETS["h20"]
    assert h20.matrix.peak("bf16") == 148e12 and h20.matrix.peak("fp8") == 296e12
    assert h20.memory.bandwidth == 4.0e12 and h20.memory.capacity == 96 * 10**9
    assert h20.matrix.units == 78


def test_infiniband_presets_are_400_and_200_gigabit():
    assert LINK_PRESETS["ib-ndr"].bandwidth == 400e9 / 8
    assert LINK_PRESETS["ib-hdr"].bandwidth == 200e9 / 8
    assert 1e-6 <= LINK_PRESETS["ib-ndr"].latency <= 20e-6


def test_nodes_of_h20_are_joined_by_infiniband():
    c = Cluster.parse("4x(8xh20)@ib-ndr")
    assert c.device_names == ("h20",) * 32
    assert c.num_nodes == 4 and c.nodes == tuple(i // 8 for i in range(32))
    assert c.inter_node == LINK_PRESETS["ib-ndr"]
    names = [link.name for link in c.links]
    assert [i for i, name in enumerate(names) if name == "ib-ndr"] == [7, 15, 23]
    assert set(names) == {"nvlink4", "ib-ndr"}


def test_heterogeneous_nodes_keep_their_own_link():
    c = Cluster.parse("(8xh100-sxm)+(8xa100-80gb)@ib-hdr")
    assert c.device_names == ("h100-sxm",) * 8 + ("a100-80gb",) * 8
    assert c.node_devices(1) == tuple(range(8, 16))
    assert c.link(0, 7).name == "nvlink4"
    assert c.link(9, 15).name == "nvlink3"
    assert c.link(3, 12).name == "ib-hdr" and c.link(12, 3).name == "ib-hdr"


def test_a_node_link_is_written_inside_its_parentheses():
    c = Cluster.parse("2X( 4xA100-80GB@pcie4 ) @ ib-hdr")
    assert [link.name for link in c.links] == ["pcie4"] * 3 + ["ib-hdr"] + ["pcie4"] * 3


def test_one_node_in_parentheses_is_the_chain_string():
    assert Cluster.parse("(2xh100-sxm+2xa100-80gb)") == Cluster.parse("2xh100-sxm+2xa100-80gb")


def test_chain_strings_are_one_node_and_link_by_their_slowest_hop():
    c = Cluster.parse("2xh100-sxm+2xa100-80gb")
    assert c.nodes == (0, 0, 0, 0) and c.num_nodes == 1 and c.inter_node is None
    assert c.link(0, 1).name == "nvlink4"
    assert c.link(0, 3).name == "nvlink3"  # the path crosses the A100's NVLink 3
    assert str(c) == "2xh100-sxm@nvlink4+2xa100-80gb@nvlink3"


@pytest.mark.parametrize("text", ["4x(8xh20)@ib-ndr", "(8xh100-sxm)+(8xa100-80gb)@ib-hdr",
                                  "2x(4xa100-80gb@pcie4)+(2xh20)@ib-ndr", "(8xh20)@ib-ndr"])
def test_topology_strings_round_trip(text):
    c = Cluster.parse(text)
    assert Cluster.parse(str(c)) == c


def test_link_lookup_refuses_a_device_to_itself_and_out_of_range():
    c = Cluster.parse("2x(2xh20)@ib-ndr")
    with pytest.raises(SpecError, match="no link to itself"):
        c.link(1, 1)
    with pytest.raises(SpecError, match="index 4 out of range.*0..3"):
        c.link(0, 4)


@pytest.mark.parametrize(("text", "wrong"), [
    ("4x(8xh20)", "4 nodes but no link between them"),
    ("4x(8xh20)@ib-xdr", "inter-node link: unknown link preset 'ib-xdr'"),
    ("4x(8xh20", "every node in parentheses"),
    ("(8xh20)+2xh20@ib-ndr", "every node in parentheses"),
    ("(8xh20)@ib-ndr+(8xh20)@ib-ndr", "once at the end"),
    ("((8xh20))@ib-ndr", "nested parentheses"),
    ("8xh20)", "without its '('"),
    ("0x(8xh20)@ib-ndr", "has no devices"),
    ("4x()@ib-ndr", "has no devices"),
    ("2x(8xh2)@ib-ndr", "unknown device preset 'h2'"),
])
def test_bad_topology_string_names_the_text_the_fault_and_the_fix(text, wrong):
    with pytest.raises(SpecError) as info:
        Cluster.parse(text)
    message = str(info.value)
    assert repr(text) in message and wrong in message
    assert "4x(8xh20)@ib-ndr" in message or "ib-ndr" in message  # how to write it


def test_cluster_record_checks_its_nodes():
    h20, nvl, ib = DEVICE_PRESETS["h20"], LINK_PRESETS["nvlink4"], LINK_PRESETS["ib-ndr"]
    with pytest.raises(SpecError, match="no inter_node link"):
        Cluster(devices=(h20, h20), links=(nvl,), nodes=(0, 1))
    with pytest.raises(SpecError, match=r"links\[0\] joins nodes 0 and 1.*'ib-ndr'"):
        Cluster(devices=(h20, h20), links=(nvl,), nodes=(0, 1), inter_node=ib)
    with pytest.raises(SpecError, match="in chain order"):
        Cluster(devices=(h20, h20), links=(ib,), nodes=(0, 2), inter_node=ib)


def test_ring_all_reduce_inside_a_node_matches_the_formula():
    # 8 members, 1 GB: 2·7/8 · 1e9 / 370e9 + 14 · 8 µs
    cost = collective_cost("8xh20", "all_reduce", 1e9, range(8))
    assert cost.algorithm == "ring"
    assert cost.seconds == pytest.approx(1.75e9 / 370e9 + 14 * 8e-6)
    tree = dict(cost.candidates)["tree"]
    assert tree == pytest.approx(2 * 3 * (8e-6 + 1e9 / 370e9))


def test_tree_all_reduce_wins_on_small_messages():
    # 1 kB over 8: ring ≈ 14 · 8 µs = 112 µs, tree ≈ 2 · 3 · 8 µs = 48 µs
    cost = collective_cost("8xh20", "all_reduce", 1e3, range(8))
    assert cost.algorithm == "tree"
    assert cost.seconds == pytest.approx(6 * (8e-6 + 1e3 / 370e9))
    assert dict(cost.candidates)["ring"] == pytest.approx(1.75e3 / 370e9 + 112e-6)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_scatter_and_all_to_all_take_n_minus_one_steps(collective):
    # 4 members, 100 MB: 3/4 · 1e8 / 370e9 + 3 · 8 µs
    cost = collective_cost("8xh20", collective, 1e8, (2, 3, 4, 5))
    assert cost.algorithm == "ring" and len(cost.candidates) == 1
    assert cost.seconds == pytest.approx(0.75e8 / 370e9 + 3 * 8e-6)


def test_a_group_across_nodes_is_hierarchical_and_priced_by_hand():
    c = Cluster.parse("2x(4xh20)@ib-ndr")
    cost = collective_cost(c, "all_reduce", 1e9, range(8))
    inside = 0.75e9 / 370e9 + 3 * 8e-6  # reduce-scatter of 1 GB over 4 on NVLink
    across = 1.0 * 0.25e9 / 50e9 + 2 * 10e-6  # ring all-reduce of 1/4 GB over 2 on NDR
    assert cost.algorithm == "hierarchical"
    assert cost.seconds == pytest.approx(2 * inside + across)
    flat = dict(cost.candidates)
    assert flat["ring"] == pytest.approx(1.75e9 / 50e9 + 14 * 10e-6)  # slowest link: NDR
    assert flat["tree"] == pytest.approx(6 * (10e-6 + 1e9 / 50e9))


def test_a_group_inside_one_node_beats_the_same_size_spread_over_two():
    c = Cluster.parse("2x(8xh20)@ib-ndr")
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        inside = collective_cost(c, collective, 64e6, (0, 1, 2, 3)).seconds
        spread = collective_cost(c, collective, 64e6, (6, 7, 8, 9)).seconds
        assert inside < spread, collective


def test_a_group_of_one_costs_nothing():
    cost = collective_cost("4x(8xh20)@ib-ndr", "all_reduce", 1e9, [5])
    assert cost.seconds == 0.0 and cost.algorithm == "none"


def test_hierarchical_all_reduce_uses_the_smallest_node_share():
    # 3 members in node 0, 1 in node 1: the lone member sends all B across (k = 1)
    c = Cluster.parse("2x(4xh20)@ib-ndr")
    cost = collective_cost(c, "all_reduce", 1e9, (0, 1, 2, 4))
    inside = 2 / 3 * 1e9 / 370e9 + 2 * 8e-6
    across = min(1e9 / 50e9 + 2 * 10e-6, 2 * (10e-6 + 1e9 / 50e9))
    assert dict(cost.candidates)["hierarchical"] == pytest.approx(2 * inside + across)


@pytest.mark.parametrize(("collective", "nbytes", "group", "wrong"), [
    ("broadcast", 1.0, (0, 1), "is not priced"),
    ("all_reduce", -1.0, (0, 1), "nbytes must be"),
    ("all_reduce", 1.0, (), "group is empty"),
    ("all_reduce", 1.0, (0, 8), r"\[8\] are not in the cluster"),
    ("all_reduce", 1.0, (1, 1), "names a device twice"),
])
def test_bad_collective_requests_are_refused_by_name(collective, nbytes, group, wrong):
    with pytest.raises(SpecError, match=wrong):
        collective_cost("8xh20", collective, nbytes, group)


def test_one_member_per_node_is_a_flat_ring_or_tree_over_the_inter_node_link():
    c = Cluster.parse("2x(4xh20)@ib-ndr")
    cost = collective_cost(c, "all_reduce", 1e6, (0, 4))
    assert dict(cost.candidates).keys() == {"ring", "tree"}  # nothing to do inside a node
    assert dict(cost.candidates)["ring"] == pytest.approx(1e6 / 50e9 + 2 * 10e-6)


def test_tree_depth_rounds_up_for_groups_that_are_not_powers_of_two():
    cost = collective_cost("8xh20", "all_reduce", 1e3, (0, 1, 2))
    assert dict(cost.candidates)["tree"] == pytest.approx(2 * 2 * (8e-6 + 1e3 / 370e9))
