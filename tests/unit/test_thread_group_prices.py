"""Prices of CPU thread groups (the threads executor's meetings): the formulas by hand on
synthetic calibrations, the layer price they make, and the 2xcpu choice they drive on a
Qwen2-shaped prefill. Nothing here depends on this machine's speed: every rate is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.thread_groups import ThreadGroupSpec, thread_collective_seconds
from tppc.driver.options import CompileOptions
from tppc.driver.planning import length_planner
from tppc.errors import SpecError
from tppc.examples.hf import hf_llama
from tppc.frontend.front_end import capture_front_end
from tppc.passes.sharding.annotate_shards import annotate_shards

SLOW = ThreadGroupSpec(handoff=2e-3, reduce_bandwidth=1e9, gather_bandwidth=0.5e9,
                       imbalance=0.25)
FREE = ThreadGroupSpec(handoff=1e-7, reduce_bandwidth=1e15, gather_bandwidth=1e15,
                       imbalance=0.0)


def _cpus(spec: ThreadGroupSpec | None, n: int = 2) -> Cluster:
    """``n`` CPUs of the pinned calibration's rates with ``spec`` as their thread group."""
    base = Cluster.parse(f"{n}xcpu")
    cpu = dataclasses.replace(base.devices[0], thread_group=spec)
    return Cluster(devices=(cpu,) * n, links=base.links)


def test_thread_collectives_are_the_formula() -> None:
    b = 4e6
    assert thread_collective_seconds(SLOW, "all_reduce", b, 2) == pytest.approx(2e-3 + b / 1e9)
    assert thread_collective_seconds(SLOW, "all_reduce", b, 4) == \
        pytest.approx(2e-3 + 3 * b / 1e9)  # the last member adds three partial sums
    assert thread_collective_seconds(SLOW, "all_gather", b, 2) == pytest.approx(2e-3 + b / 5e8)
    assert thread_collective_seconds(SLOW, "all_gather", b, 2, in_place=True) == 2e-3
    assert thread_collective_seconds(SLOW, "all_reduce", b, 1) == 0.0
    with pytest.raises(SpecError, match="broadcast"):
        thread_collective_seconds(SLOW, "broadcast", b, 2)
    with pytest.raises(SpecError, match="imbalance"):
        ThreadGroupSpec(handoff=0.0, reduce_bandwidth=1.0, gather_bandwidth=1.0, imbalance=-1)


@pytest.fixture(scope="module")
def front():
    model, args, kwargs = hf_llama(seq_len=32, layers=2)  # hidden 64, vocab 128, fp32
    fe = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    annotate_shards(fe.chunk)
    return fe


def _layer(front, cluster: Cluster, i: int):
    table, _ = group_cost_table(front.chunk, front.ctx.layers, cluster, 4096, ((0, 1),),
                                seq_symbol=front.ctx.seq_symbol,
                                token_count=front.ctx.token_count)
    return table.layers[0][i]


def test_a_thread_group_layer_adds_the_barrier_wait_and_its_own_collectives(front) -> None:
    c, p = np.array([256.0, 1024.0]), np.zeros(2)
    block = _layer(front, _cpus(SLOW), 1)  # 2 all-reduces of 64 fp32 per token
    compute = block.time.compute[0](c, p)
    hand = 1.25 * compute + 2 * (2e-3 + 64 * 4 * c / 1e9)
    assert block.time(c, p) == pytest.approx(hand)
    head = _layer(front, _cpus(SLOW), -1)  # the logits: gathered in place, the hand-off alone
    assert head.time(c, p) == pytest.approx(1.25 * head.time.compute[0](c, p) + 2e-3)


def test_a_cpu_group_without_a_thread_calibration_keeps_the_link_price(front) -> None:
    c, p = np.array([512.0]), np.zeros(1)
    cluster = _cpus(None)
    block = _layer(front, cluster, 1)
    link = 2 * collective_cost(cluster, "all_reduce", 64 * 4 * 512.0, (0, 1)).seconds
    assert block.time(c, p) == pytest.approx(block.time.compute[0](c, p) + link)


@pytest.fixture(scope="module")
def qwen2_front():
    """The Qwen2-shaped prefill of ``benchmarks/hybrid_prefill.py`` on the meta device."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                   num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg).eval()
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    return capture_front_end(model, (ids,), {}, seq_dims=None, plan_only=True)


@pytest.mark.parametrize(("spec", "degrees"), [(SLOW, (2, 1)), (FREE, (1, 2))],
                         ids=["barriers-cost-pp2", "barriers-free-tp2"])
def test_2xcpu_picks_pp2_when_the_barriers_make_tp2_slower(qwen2_front, spec, degrees) -> None:
    plan = length_planner(CompileOptions(cluster=_cpus(spec), time_limit=2.0))(qwen2_front, 2048)
    assert (plan.degrees["num_stages"], plan.degrees["tensor_parallel"]) == degrees
    assert plan.choice is not None and plan.choice.searched + plan.choice.pruned >= 2


def test_a_co_running_calibration_carries_its_thread_group(tmp_path, monkeypatch,
                                                           real_calibration) -> None:
    from tppc.cost_models import calibration

    monkeypatch.setenv("TPPC_CACHE_DIR", str(tmp_path))
    rates = {"fp32": 1e11, "half_rows": 8.0, "attention_efficiency": 0.7, "op_overhead": 1e-6,
             "bandwidth": 2e10, "vector": 5e9, "capacity": 2.0**34}
    group = {"group_handoff": 2e-3, "group_reduce_bandwidth": 1e9,
             "group_gather_bandwidth": 0.5e9, "group_imbalance": 0.25, "group_members": 2.0}
    monkeypatch.setattr(calibration, "measure_device", lambda device: dict(rates))
    monkeypatch.setattr(calibration, "measure_thread_group", lambda n: dict(group))
    assert calibration.calibrate("cpu", co_running=2).thread_group == SLOW
    assert calibration.calibrate("cpu", co_running=2).thread_group == SLOW  # from the cache
    assert calibration.calibrate("cpu").thread_group is None  # one stage: no group


def test_the_executor_meeting_is_measured() -> None:
    from tppc.cost_models.thread_groups import measure_thread_group

    measured = ThreadGroupSpec.from_measured(measure_thread_group(members=2, rounds=1))
    assert measured is not None and measured.members == 2
    assert 0 < measured.handoff < 1 and measured.reduce_bandwidth > 0
