"""How many intra-op threads a worker on a CPU device runs: its device's share of the cores.

Terms:
    machine cores: the CPUs this process may run on (its affinity mask; ``os.cpu_count()``
        where the platform has none). Logical CPUs: with hyper-threading, two per core.
    CPU device: a ``cpu`` device of the plan's cluster (``"2xcpu"`` names two). The CPU
        devices of a cluster share this machine, so each gets an equal share of its cores,
        at least one. A worker's intra-op threads follow its device, never torch's global
        thread count, which the user (or another worker) may have set to anything.

Example:
    >>> cores_per_device(2) == max(1, machine_cores() // 2)
    True
"""

from __future__ import annotations

import os

__all__ = ["cores_per_device", "machine_cores"]


def machine_cores() -> int:
    """The CPUs this process may run on (module docstring)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def cores_per_device(cpu_devices: int) -> int:
    """Intra-op threads of a worker on one of ``cpu_devices`` CPU devices that share this
    machine: the machine's cores shared equally, at least one each."""
    return max(1, machine_cores() // max(1, cpu_devices))
