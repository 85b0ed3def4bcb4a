"""How many intra-op threads a worker on a CPU device runs: its device's share of the cores.

Terms:
    logical CPUs: the CPUs this process may run on (its affinity mask; ``os.cpu_count()``
        where the platform has none). With hyper-threading (SMT), two or more per core.
    machine cores: the *physical* cores behind those logical CPUs: logical CPUs that are
        SMT siblings (``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``, Linux)
        count once; where the topology cannot be read, the logical CPUs. Thread counts use
        physical cores, as torch's own default does: two threads on the siblings of one core
        share its floating-point units, so a GEMM gains nothing from the second (and
        two workers whose threads land on one core's siblings slow each other down).
        The CPU price does not read this: a ``cpu`` device is calibrated by measurement
        (:mod:`tppc.cost_models.calibration`, whose co-running count is capped at the
        logical CPUs: it measures what that many threads really get).
    CPU device: a ``cpu`` device of the plan's cluster (``"2xcpu"`` names two). The CPU
        devices of a cluster share this machine, so each gets an equal share of its cores,
        at least one. A worker's intra-op threads follow its device, never torch's global
        thread count, which the user (or another worker) may have set to anything.
    rank: one process of a ``backend="distributed"`` job (torchrun, ``tppc.launch``). Its
        program is built on the meta device, so its worker carries no thread count; the rank
        runs its CPU device's share (:func:`rank_threads`): the machine's cores shared by the
        CPU devices on this machine, the ranks torchrun started here (``LOCAL_WORLD_SIZE``)
        or the cluster's CPU devices, whichever is more.

Example:
    >>> cores_per_device(2) == max(1, machine_cores() // 2)
    True
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["cores_per_device", "logical_cpus", "machine_cores", "physical_cores",
           "rank_threads"]

_TOPOLOGY = Path("/sys/devices/system/cpu")


def logical_cpus() -> tuple[int, ...]:
    """The logical CPUs this process may run on (module docstring)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0))) or (0,)
    except (AttributeError, OSError):  # no affinity on this platform
        return tuple(range(max(1, os.cpu_count() or 1)))


def physical_cores(cpus: Iterable[int], root: Path = _TOPOLOGY) -> int:
    """The physical cores behind logical ``cpus``: SMT siblings (each CPU's
    ``topology/thread_siblings_list`` under ``root``) count once; a CPU whose topology
    cannot be read counts as its own core."""
    cores: set[str | int] = set()
    for cpu in cpus:
        try:
            siblings = (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            cores.add(cpu)
            continue
        cores.add(",".join(sorted(siblings.split())))  # e.g. "0,4" or "0-1": one core
    return max(1, len(cores))


def machine_cores() -> int:
    """The physical cores this process may run on (module docstring)."""
    return physical_cores(logical_cpus())


def cores_per_device(cpu_devices: int) -> int:
    """Intra-op threads of a worker on one of ``cpu_devices`` CPU devices that share this
    machine: the machine's (physical) cores shared equally, at least one each."""
    return max(1, machine_cores() // max(1, cpu_devices))


def rank_threads(threads_per_stage: int | Sequence[int] | None, stage: int,
                 local_ranks: int, cluster_cpus: int = 0) -> int:
    """The intra-op threads of a rank on a CPU device (module docstring).

    Args:
        threads_per_stage: the user's count (``threads_per_stage=``, ``--threads``): one for
            every stage, or one per stage; None: the device's share.
        stage: the stage the rank's worker belongs to (indexes a per-stage tuple).
        local_ranks: the job's ranks on this machine (``LOCAL_WORLD_SIZE``).
        cluster_cpus: the CPU devices the plan's cluster names on one machine (0: unknown).
    """
    if isinstance(threads_per_stage, int):
        return threads_per_stage
    if threads_per_stage is not None:
        return threads_per_stage[min(stage, len(threads_per_stage) - 1)]
    return cores_per_device(max(local_ranks, cluster_cpus, 1))
