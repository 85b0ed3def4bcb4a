"""Micro-benchmarks of one device: the rates and overheads a :class:`DeviceSpec` is built from.

Measured, for one thread count (a pipeline stage on CPU runs with
``torch.set_num_threads(1)`` by default, so that is the default here):

    matrix peak and half rows (CPU): fp32 linears of m = 16 ... 512 rows on weights that do
        not fit in L2 (16 MiB); ``t(m) = 2·n·k·(m + m½) / peak`` fitted to the times, so
        skinny matmuls are priced at m / (m + m½) of peak. bf16 where the CPU runs it
        natively fast. On GPUs: the best of large matmuls per dtype, m½ = 0;
    attention efficiency: ``tppc::chunk_attention`` (8 heads of 64, 2 K/V heads, a causal
        chunk of 256 queries after 768 keys) against the matmul model of its two matmuls
        over the keys it visits;
    weight streaming (CPU): a linear whose weight is 4× the last-level cache, timed against
        the curve above; the excess per weight byte prices the GEMM's packing pass over
        weights beyond the cache (an LM head), which does not overlap the multiply;
    memory bandwidth: ``out = a + b`` on arrays well above the last-level cache
        (3 arrays of 64 MiB on CPU), bytes moved / time;
    vector throughput: elementwise ops on L2-resident arrays, the slope between two sizes;
    op overhead: the time per op of a tiny pre-norm transformer block of ``nn.Module``
        calls (module ``__call__``, Python dispatch, launch; its views are not counted);
    view and attention overhead (CPU): per view node and per chunk-attention call of a
        stage graph (:mod:`.dispatch`);
    thread groups (CPU, ``co_running >= 2``): the threads executor's collectives among
        ``co_running`` worker threads, their hand-off, serial sum and gather rates and the
        barrier wait (:mod:`.thread_groups`), measured with no other load (the members are
        the load).

Every timing is the fastest of a few ~20 ms batches: on a shared machine the least
disturbed batch is the best estimate of what the device can do. ``co_running=k`` measures
all of it while ``k - 1`` other threads run a stage's load, as ``k`` CPU stages of one
pipeline do (``Cluster.parse("2xcpu")`` asks for ``k = 2``).

:func:`measure_device` runs all but the thread groups and returns the raw numbers (the keys of
a calibration file's ``"measured"``); :func:`tppc.cost_models.calibration.calibrate` adds the
thread groups (:func:`.thread_groups.measure_thread_group`), caches them and builds the spec.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from tppc.cost_models.dispatch import attention_overhead, view_overhead

__all__ = ["co_running_load", "measure_device", "timer"]


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """A function that returns the fastest per-call seconds of ``fn`` over ``reps`` batches."""

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
        return min(samples)

    return measure


class _Norm(torch.nn.Module):
    """RMS norm written out as eager ops: pow, mean, add, rsqrt, mul, mul (6 ops)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _TinyBlock(torch.nn.Module):
    """A pre-norm transformer block of ``nn.Module`` calls on tiny tensors (34 ops).

    Its time is per-op overhead: Python dispatch, module ``__call__``, kernel launch.
    Ops (as an exported graph counts them; views are free): 2 norms (12), q/k/v/o and
    gate/up/down linears (7), rotary on q and k (10: neg, cat, 3 mul/add each), SDPA with
    a boolean mask (1), silu and the gating mul (2), two residual adds (2).
    """

    ops = 34

    def __init__(self, device: torch.device, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = _Norm(dim), _Norm(dim)
        self.q, self.k, self.v, self.o = lin(dim, dim), lin(dim, dim), lin(dim, dim), \
            lin(dim, dim)
        self.gate, self.up, self.down = lin(dim, 2 * dim), lin(dim, 2 * dim), lin(2 * dim, dim)
        self.to(device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        h = x + self._attention(self.norm1(x), cos, sin, mask)
        n = self.norm2(h)
        return h + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))


def _op_overhead(device: torch.device, measure) -> float:
    """Seconds per op of :class:`_TinyBlock` run eagerly under ``inference_mode``."""
    block, t = _TinyBlock(device), 4
    x = torch.randn(1, t, 8, device=device)
    cos, sin = torch.ones(t, block.head_dim, device=device), torch.zeros(t, block.head_dim,
                                                                         device=device)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()

    def run() -> None:
        with torch.inference_mode():
            block(x, cos, sin, mask)

    return measure(run, 7) / _TinyBlock.ops


def _matmul_peak(device: torch.device, dtype: torch.dtype, measure, sizes) -> float:
    best = 0.0
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        seconds = measure(lambda a=a, b=b: torch.mm(a, b), 5)
        best = max(best, 2.0 * m * k * n / seconds)
    return best


_ROWS = (16, 32, 64, 128, 512)


def _matmul_curve(device: torch.device, measure) -> tuple[float, float]:
    """``(peak FLOP/s, half_rows)`` of fp32 linears whose weights do not fit in L2.

    Four 1024 × 1024 weights (16 MiB, as a layer's weights stream from L3 or DRAM) are
    applied to m rows for m in ``_ROWS``; ``t(m) = 2·n·k·(m + m½) / peak`` is fitted by
    least squares on relative error: the slope gives the peak, the intercept m½.
    """
    n = k = 1024
    weights = [torch.randn(n, k, device=device) for _ in range(4)]
    rows = np.array(_ROWS, dtype=float)
    times = []
    for m in _ROWS:
        x = torch.randn(m, k, device=device)

        def chain(x: torch.Tensor = x) -> None:
            for w in weights:
                torch.nn.functional.linear(x, w)

        times.append(measure(chain, 5) / len(weights))
    t = np.array(times)
    slope, intercept = np.polyfit(rows, t, 1, w=1.0 / t)
    peak = 2.0 * n * k / slope
    return peak, float(max(intercept / slope, 0.0))


def _last_level_cache() -> int:
    """Bytes of the CPU's largest cache (sysfs), 32 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text(encoding="utf-8").strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 * 2**20)


def _stream_bandwidth(device: torch.device, measure, peak: float, half_rows: float,
                      cache: int) -> float:
    """Bytes/s of the pass a GEMM makes over a weight 4× the last-level cache (0: none).

    A linear of 128 rows on a 1024-column weight of ``4 · cache`` bytes is timed against
    the skinny-matmul curve (fitted on weights that fit); the time above the curve,
    per weight byte, is the packing pass that streams the weight from memory.
    """
    k, m = 1024, 128
    n = max(1024, 4 * cache // (4 * k))
    w = torch.empty(n, k, device=device).uniform_()
    x = torch.randn(m, k, device=device)
    out = torch.zeros(m, n, device=device)
    seconds = measure(lambda: torch.ops.aten.linear.out(x, w, out=out), 3)
    excess = seconds - 2.0 * n * k * (m + half_rows) / peak
    return float(4 * n * k / excess) if excess > 0.02 * seconds else 0.0


def _vector_rate(device: torch.device, measure, m: int) -> float:
    """Elements/s of an elementwise op on arrays that stay in cache (CPU: ``m`` = 2**15,
    128 KiB each), from the slope between ``m`` and ``4m`` elements: the per-op overhead
    cancels (subtracting a separately measured overhead left nothing on 2 intra-op threads,
    whose dispatch costs more than the small op's work). A slope lost in noise falls back to
    the whole time of the larger op (the rate then includes its overhead: a lower bound).
    """
    times = []
    for n in (m, 4 * m):
        x = torch.ones(n, device=device)
        y = torch.empty(n, device=device)
        times.append(measure(lambda x=x, y=y: torch.mul(x, 1.0001, out=y), 7))
    slope = times[1] - times[0]
    return 3 * m / slope if slope > 0.25 * times[1] else 4 * m / times[1]


def _attention_efficiency(device: torch.device, measure, peak: float, half_rows: float
                          ) -> float:
    """Fraction of ``peak`` the attention that runs reaches: ``tppc::chunk_attention`` (the
    op every emitted program calls), causal, a chunk of 256 queries after 768 prefix keys,
    8 heads of 64 over 2 grouped K/V heads, priced as the cost model prices it: the keys it
    visits (``p + (c + 1)/2`` per row) at the skinny-matmul curve; this is what is left.
    """
    from tppc.ir import ops

    heads, kv_heads, dim, rows, prefix = 8, 2, 64, 256, 768
    q = torch.randn(1, rows, heads, dim, device=device).transpose(1, 2)  # as HF lays it out
    k = torch.randn(1, kv_heads, prefix + rows, dim, device=device)
    v = torch.randn(1, kv_heads, prefix + rows, dim, device=device)
    with torch.inference_mode():
        seconds = measure(lambda: ops.chunk_attention(q, k, v, prefix, True, None, True), 9)
    modelled = 4.0 * heads * (rows + half_rows) * (prefix + (rows + 1) / 2) * dim / peak
    return float(min(1.0, max(0.05, modelled / seconds)))


@contextlib.contextmanager
def co_running_load(device: torch.device, others: int, threads: int) -> Iterator[None]:
    """Run ``others`` threads of a pipeline stage's load while the body measures.

    Stages on one CPU share its last-level cache, its memory bandwidth and the interpreter
    lock: measured alone, a core is faster than it is while its neighbours run their own
    stages. Each thread (``threads`` intra-op threads, as a stage worker) loops over the
    ops a transformer block spends its time in: linears whose weights stream from memory
    (4 of 1024 × 1024 on 128 rows), causal attention, an elementwise product.
    """
    if others <= 0 or device.type != "cpu":
        yield
        return
    stop = threading.Event()

    def stage_load() -> None:
        torch.set_num_threads(threads)
        weights = [torch.randn(1024, 1024) for _ in range(4)]
        x = torch.randn(128, 1024)
        q = torch.randn(1, 8, 128, 64)
        kv = torch.randn(1, 8, 1024, 64)
        with torch.inference_mode():
            while not stop.is_set():
                for w in weights:
                    torch.nn.functional.linear(x, w)
                torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
                torch.mul(x, x)

    workers = [threading.Thread(target=stage_load, daemon=True) for _ in range(others)]
    for w in workers:
        w.start()
    time.sleep(0.05)  # let them reach their loop
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join()


def measure_device(device: torch.device) -> dict[str, float]:
    measure = timer(device)
    gpu = device.type == "cuda"
    out: dict[str, float] = {}
    if gpu:
        sizes = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 8192, 8192)]
        out["fp32"] = _matmul_peak(device, torch.float32, measure, sizes)
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            out[name] = _matmul_peak(device, dtype, measure, sizes)
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            out["tf32"] = _matmul_peak(device, torch.float32, measure, sizes[:1])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        out["half_rows"] = 0.0  # GPU skinny matmuls: tile padding of the presets, not fitted
    else:
        out["fp32"], out["half_rows"] = _matmul_curve(device, measure)
        bf16 = _matmul_peak(device, torch.bfloat16, measure, [(256, 1024, 1024)])
        if bf16 > out["fp32"]:  # only native bf16 (AMX, AVX512-BF16) beats fp32
            out["bf16"] = bf16
        out["cache_bytes"] = float(_last_level_cache())
        out["stream_bandwidth"] = _stream_bandwidth(device, measure, out["fp32"],
                                                    out["half_rows"], int(out["cache_bytes"]))
    out["attention_efficiency"] = _attention_efficiency(device, measure, out["fp32"],
                                                        out["half_rows"])
    out["op_overhead"] = _op_overhead(device, measure)
    if not gpu:  # GPU kernels run asynchronously: the host's dispatch hides behind them
        out["view_overhead"] = view_overhead(measure)
        out["attention_overhead"] = attention_overhead(measure, out["op_overhead"])

    n = (256 if gpu else 16) * 2**20 // 4 * 4  # 3 × 64 MiB on CPU, 3 × 1 GiB on GPU
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.empty(n, device=device)
    seconds = measure(lambda: torch.add(a, b, out=c), 5)
    out["bandwidth"] = 3 * 4 * n / max(seconds - out["op_overhead"], 1e-9)

    out["vector"] = _vector_rate(device, measure, 2**24 if gpu else 2**15)
    if gpu:
        out["capacity"] = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 2**22
        out["capacity"] = float(pages * os.sysconf("SC_PAGE_SIZE"))
    return out
