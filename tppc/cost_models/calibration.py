"""Calibration: measure this machine's device with micro-benchmarks and return a DeviceSpec.

Measured, for one thread count (a pipeline stage on CPU runs with
``torch.set_num_threads(1)`` by default, so that is the default here):

    matrix peak: the best FLOP/s of square and skinny fp32 matmuls (and bf16 where the
        CPU or GPU runs it natively fast), several sizes, median of repeats;
    memory bandwidth: ``out = a + b`` on arrays well above the last-level cache
        (3 arrays of 64 MiB on CPU), bytes moved / time;
    vector throughput: elementwise ops on an L2-resident array, overhead subtracted;
    op overhead: the time per op of a block-like sequence of ops on tiny tensors
        (Python dispatch + launch; views included in the sequence but not counted).

Results are cached as JSON in ``$TPPC_CACHE_DIR`` or ``$XDG_CACHE_HOME/tppc`` or
``~/.cache/tppc``, keyed by device, thread count, CPU model and torch version;
``force=True`` measures again. One calibration takes about 5-10 s.

Example:
    >>> spec = calibrate("cpu")            # doctest: +SKIP
    >>> spec.name, spec.ridge_point("fp32")  # doctest: +SKIP
    ('cpu', 7.1...)
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import SpecError
from .specs import DeviceSpec, MatrixUnit, Memory, VectorUnit

__all__ = ["cache_dir", "calibrate"]

_SCHEMA = 2


def cache_dir() -> Path:
    """Directory of tppc's cache (``$TPPC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tppc``)."""
    if os.environ.get("TPPC_CACHE_DIR"):
        return Path(os.environ["TPPC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tppc"


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


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """A function that returns the median seconds of ``fn`` over ``reps`` timed batches."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn: Callable[[], object], reps: int) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-7)
        inner = max(1, min(1000, int(0.02 / one)))  # ~20 ms per batch
        samples = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / inner)
        samples.sort()
        return samples[len(samples) // 2]

    return measure


_TINY_BLOCK_OPS = 12


def _tiny_block(device: torch.device) -> Callable[[], object]:
    """A transformer-block-like op sequence on tiny tensors: its time is pure overhead.

    The per-op overhead of eager execution is Python dispatch plus kernel launch; a
    1-element ``add`` underestimates it, so time a realistic mix (linear, norm, rope-like
    elementwise, softmax) and divide by its ``_TINY_BLOCK_OPS`` kernel-launching ops.
    """
    x = torch.ones(1, 4, 8, device=device)
    w = torch.ones(8, 8, device=device)

    def block() -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # 5 ops
        q = torch.nn.functional.linear(h, w).view(1, 4, 2, 4).transpose(1, 2)  # 1 op
        a = torch.softmax(q * 0.5, dim=-1)  # 2 ops
        g = torch.nn.functional.silu(torch.nn.functional.linear(h, w))  # 2 ops
        return a.transpose(1, 2).reshape(1, 4, 8) * g + x  # 2 ops

    return block


def _matmul_peak(device: torch.device, dtype: torch.dtype, measure, sizes) -> float:
    best = 0.0
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        seconds = measure(lambda a=a, b=b: torch.mm(a, b), 5)
        best = max(best, 2.0 * m * k * n / seconds)
    return best


def _measure(device: torch.device) -> dict[str, float]:
    measure = _timer(device)
    gpu = device.type == "cuda"
    sizes = ([(4096, 4096, 4096), (8192, 8192, 8192), (2048, 8192, 8192)] if gpu
             else [(256, 1024, 1024), (512, 512, 2048), (1024, 1024, 1024)])
    out: dict[str, float] = {"fp32": _matmul_peak(device, torch.float32, measure, sizes)}
    if gpu:
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            out[name] = _matmul_peak(device, dtype, measure, sizes)
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            out["tf32"] = _matmul_peak(device, torch.float32, measure, sizes[:1])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    else:
        bf16 = _matmul_peak(device, torch.bfloat16, measure, sizes[:1])
        if bf16 > out["fp32"]:  # only native bf16 (AMX, AVX512-BF16) beats fp32
            out["bf16"] = bf16

    out["op_overhead"] = measure(_tiny_block(device), 7) / _TINY_BLOCK_OPS

    n = (256 if gpu else 16) * 2**20 // 4 * 4  # 3 × 64 MiB on CPU, 3 × 1 GiB on GPU
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.empty(n, device=device)
    seconds = measure(lambda: torch.add(a, b, out=c), 5)
    out["bandwidth"] = 3 * 4 * n / max(seconds - out["op_overhead"], 1e-9)

    m = 2**24 if gpu else 2**15  # in cache: 128 KiB per array on CPU
    x = torch.ones(m, device=device)
    y = torch.empty(m, device=device)
    seconds = measure(lambda: torch.mul(x, 1.0001, out=y), 7)
    out["vector"] = m / max(seconds - out["op_overhead"], 1e-9)
    if gpu:
        out["capacity"] = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 2**22
        out["capacity"] = float(pages * os.sysconf("SC_PAGE_SIZE"))
    return out


def _spec_from(name: str, measured: dict[str, float], description: str) -> DeviceSpec:
    peaks = {k: measured[k] for k in ("fp32", "tf32", "bf16", "fp16") if k in measured}
    return DeviceSpec(
        name=name,
        matrix=MatrixUnit(peak_flops=peaks),
        vector=VectorUnit(peak_flops=measured["vector"]),
        memory=Memory(bandwidth=measured["bandwidth"], capacity=int(measured["capacity"])),
        op_overhead=measured["op_overhead"],
        description=description,
    )


def calibrate(device: str = "cpu", *, threads: int | None = 1, force: bool = False
              ) -> DeviceSpec:
    """Measure ``device`` (``"cpu"`` or ``"cuda:N"``) and return its spec (cached).

    Args:
        device: ``"cpu"`` or a CUDA device string.
        threads: CPU threads to measure with (``torch.set_num_threads``), restored after;
            ``None`` keeps the current setting. Ignored for CUDA.
        force: measure again even when a cached result exists.

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
    key = f"{dev.type}{'' if dev.index is None else dev.index}-t{n_threads}-{_slug(hw)}-" \
          f"torch{_slug(torch.__version__)}"
    path = cache_dir() / "calibration" / f"{key}.json"
    if path.exists() and not force:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("schema") == _SCHEMA:
                return _spec_from(data["name"], data["measured"], data["description"])
        except (OSError, ValueError, KeyError, SpecError):
            pass  # unreadable cache: measure again
    old_threads = torch.get_num_threads()
    if dev.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    try:
        measured = _measure(dev)
    finally:
        torch.set_num_threads(old_threads)
    name = "cpu" if dev.type == "cpu" else f"cuda{dev.index}"
    description = f"calibrated {hw}, {n_threads} thread(s), torch {torch.__version__}"
    spec = _spec_from(name, measured, description)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"schema": _SCHEMA, "name": name, "description": description,
                                   "measured": measured}, indent=2), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # read-only cache dir: the spec is still returned
    return spec
