"""Calibration: measure this machine's device with micro-benchmarks and return a DeviceSpec.

The measurements (:mod:`.device_benchmarks`): matrix peaks and the skinny-matmul curve,
attention efficiency, weight streaming, memory bandwidth, vector throughput, op, view and
attention overheads, and (CPU, ``co_running >= 2``) the thread groups.

Results are cached (:mod:`.calibration_store`), keyed by device, thread count, CPU model and
torch version; ``force=True`` measures again. One CPU calibration takes about 2 s. A pinned
calibration (``$TPPC_CALIBRATION``, a JSON file; ``threads=k > 1``: its ``"<co_running>t<k>"``
entry) is returned without measuring: plans then do
not depend on this machine's speed or load; the test suite pins one (``tests/data``), and a
user can pin the calibration measured once on an idle machine.

Example:
    >>> spec = calibrate("cpu")            # doctest: +SKIP
    >>> spec.name, spec.ridge_point("fp32")  # doctest: +SKIP
    ('cpu', 7.1...)
"""

from __future__ import annotations

import contextlib
import os
import platform
import re

import torch

from tppc.cost_models.calibration_store import cache_dir, pinned, read_cached, write_cached
from tppc.cost_models.device_benchmarks import co_running_load, measure_device
from tppc.cost_models.specs import DeviceSpec, MatrixUnit, Memory, VectorUnit
from tppc.cost_models.thread_groups import ThreadGroupSpec, measure_thread_group
from tppc.errors import SpecError

__all__ = ["cache_dir", "calibrate"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "-", text).strip("-").lower()[:60]


def _spec_from(name: str, measured: dict[str, float], description: str) -> DeviceSpec:
    peaks = {k: measured[k] for k in ("fp32", "tf32", "bf16", "fp16") if k in measured}
    return DeviceSpec(
        name=name,
        matrix=MatrixUnit(peak_flops=peaks, half_rows=measured.get("half_rows", 0.0),
                          cache_bytes=int(measured.get("cache_bytes", 0)),
                          stream_bandwidth=measured.get("stream_bandwidth", 0.0)),
        vector=VectorUnit(peak_flops=measured["vector"]),
        memory=Memory(bandwidth=measured["bandwidth"], capacity=int(measured["capacity"])),
        op_overhead=measured["op_overhead"],
        view_overhead=measured.get("view_overhead", 0.0),
        attention_overhead=measured.get("attention_overhead", 0.0),
        attention_efficiency=measured.get("attention_efficiency", 1.0),
        thread_group=ThreadGroupSpec.from_measured(measured),
        description=description,
    )


def calibrate(device: str = "cpu", *, threads: int | None = 1, force: bool = False,
              co_running: int = 1) -> DeviceSpec:
    """Measure ``device`` (``"cpu"`` or ``"cuda:N"``) and return its spec (cached).

    Args:
        device: ``"cpu"`` or a CUDA device string.
        threads: CPU threads to measure with (``torch.set_num_threads``), restored after;
            ``None`` keeps the current setting. Ignored for CUDA.
        force: measure again even when a cached result exists.
        co_running: CPU pipeline stages that run at once on this machine (``2xcpu``: 2; at
            most the core count): every rate is measured while ``co_running - 1`` other
            threads run a stage-like load (see
            :func:`tppc.cost_models.device_benchmarks.co_running_load`). Ignored for CUDA.

    Raises:
        SpecError: the device string is not ``cpu`` or an available ``cuda:N``.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise SpecError(f"calibrate: bad device {device!r}; use 'cpu' or 'cuda:N'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
            raise SpecError(f"calibrate: {device!r} is not available on this machine; use 'cpu'")
        dev = torch.device("cuda", dev.index or 0)
        hw = torch.cuda.get_device_name(dev)
        threads = None
    elif dev.type == "cpu":
        hw = _cpu_model()
    else:
        raise SpecError(f"calibrate: device type {dev.type!r} unsupported; use 'cpu' or 'cuda:N'")
    n_threads = threads if threads is not None else torch.get_num_threads()
    co_running = max(1, min(int(co_running), os.cpu_count() or 1)) if dev.type == "cpu" else 1
    together = f"-x{co_running}" if co_running > 1 else ""
    key = f"{dev.type}{'' if dev.index is None else dev.index}-t{n_threads}{together}-" \
          f"{_slug(hw)}-torch{_slug(torch.__version__)}"
    pin = os.environ.get("TPPC_CALIBRATION")
    if pin and dev.type == "cpu" and not force:
        data = pinned(pin, co_running, n_threads if threads is not None else 1)
        return _spec_from(data["name"], data["measured"], data["description"] + " (pinned)")
    path = cache_dir() / "calibration" / f"{key}.json"
    data = None if force else read_cached(path)
    if data is not None:
        with contextlib.suppress(KeyError, SpecError):  # a broken cache: measure again
            return _spec_from(data["name"], data["measured"], data["description"])
    old_threads = torch.get_num_threads()
    if dev.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    try:
        with co_running_load(dev, co_running - 1, n_threads):
            measured = measure_device(dev)
        if dev.type == "cpu" and co_running > 1:
            measured.update(measure_thread_group(co_running))
    finally:
        torch.set_num_threads(old_threads)
    name = "cpu" if dev.type == "cpu" else f"cuda{dev.index}"
    description = f"calibrated {hw}, {n_threads} thread(s), torch {torch.__version__}" + (
        f", {co_running} stages at once" if co_running > 1 else "")
    spec = _spec_from(name, measured, description)
    write_cached(path, name, description, measured)
    return spec
