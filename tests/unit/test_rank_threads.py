"""A rank's intra-op threads follow its plan device (its CPU device's share of the machine's
physical cores), as the threads executor's workers do; ``threads_per_stage`` overrides.
Ranks build their programs on the meta device, so nothing else sets them."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from tppc.distributed import rank_threads as rank_threads_module
from tppc.distributed.rank_threads import set_rank_threads
from tppc.driver.options import CompileOptions
from tppc.program import cores
from tppc.program.cores import physical_cores, rank_threads

CPU = torch.device("cpu")


def _sysfs(root, siblings: dict[int, str]) -> None:
    for cpu, text in siblings.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(text + "\n")


def test_hyper_threading_siblings_count_as_one_core(tmp_path) -> None:
    _sysfs(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})  # 2 cores x 2 threads
    assert physical_cores(range(4), tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1  # the affinity mask: one core's siblings
    _sysfs(tmp_path / "ranges", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert physical_cores(range(4), tmp_path / "ranges") == 2
    assert physical_cores(range(3), tmp_path / "none") == 3  # unreadable: logical CPUs


def test_rank_threads_share_the_cores_unless_given(monkeypatch) -> None:
    monkeypatch.setattr(cores, "machine_cores", lambda: 8)
    assert rank_threads(None, 0, local_ranks=4) == 2
    assert rank_threads(None, 0, local_ranks=2, cluster_cpus=4) == 2  # the cluster's share
    assert rank_threads(None, 0, local_ranks=16) == 1
    assert rank_threads(3, 1, local_ranks=4) == 3
    assert rank_threads((1, 5), 1, local_ranks=4) == 5


@pytest.fixture
def set_counts(monkeypatch) -> list[int]:
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(cores, "machine_cores", lambda: 8)
    return seen


def test_set_rank_threads_reads_the_ranks_on_this_machine(monkeypatch, set_counts) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")  # two machines of two ranks
    assert set_rank_threads(CompileOptions(cluster="2xcpu"), 0, CPU) == 4
    assert set_rank_threads(CompileOptions(cluster="4xcpu"), 0, CPU) == 2
    two_nodes = CompileOptions(cluster="2x(2xcpu)@eth-100g")
    assert set_rank_threads(two_nodes, 0, CPU) == 4  # per node: its 2 ranks
    assert set_rank_threads(CompileOptions(threads_per_stage=(1, 3)), 1, CPU) == 3
    assert set_counts == [4, 2, 4, 3]
    assert set_rank_threads(CompileOptions(), 0, torch.device("meta")) is None
    assert set_counts == [4, 2, 4, 3]  # not a CPU: torch's own count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("options", "want"), [({}, 3), ({"threads_per_stage": 1}, 1)])
def test_the_rank_entry_sets_its_devices_share(monkeypatch, options, want) -> None:
    """``compile_distributed`` on a job of one rank (gloo, in this process): its program is
    built on meta, yet the rank runs its CPU device's share (a machine of 3 cores, one
    device: not torch's default here) or the given count."""
    from tppc.distributed.pipeline import compile_distributed
    from tppc.examples.hf import dit

    seen: list[tuple[int, int]] = []
    real = rank_threads_module.set_rank_threads

    def spy(opts, stage, where):
        seen.append((stage, real(opts, stage, where)))

    monkeypatch.setattr("tppc.distributed.pipeline.set_rank_threads", spy)
    monkeypatch.setattr(cores, "machine_cores", lambda: 3)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    model, args, kwargs = dit(size=8, depth=2)
    try:
        cp = compile_distributed(model, args, kwargs, device="cpu", verify=False, **options)
        assert cp.program(cp.plan.seq_len).runners[0].threads is None  # built on meta
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == [(0, want), (0, want)]  # before capture, then its stage's
