"""Layer times compiled once with ``L`` as an argument: exact at every length, same plans.

The oracle is the path before the cache: each layer's time substituted at the table's
length and lambdified afresh (``sympy.lambdify`` of ``LayerExpr.time``, and a table built
with that compile in place of the cached one).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import sympy

from tppc import examples
from tppc.cost_models import compiled_times, layer_pricer
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.lambdify import NUMPY_NAMESPACE, to_numpy
from tppc.cost_models.layer_costs import build_cost_table, layer_expressions
from tppc.cost_models.node_costs import C, L, P
from tppc.frontend.annotate import annotate_program
from tppc.planner.grid import plan_any_length

pytest.importorskip("transformers")

LENGTHS = (37, 1000, 4093, 32749)  # primes and not, off and on the grid


@pytest.fixture(scope="module")
def llama():
    model, args, _kwargs = examples.hf_llama(seq_len=32, layers=2)
    return annotate_program(model, args)


@pytest.fixture(scope="module")
def dit():  # bidirectional attention over all L keys: its layer times depend on L
    model, args, _kwargs = examples.dit()
    return annotate_program(model, args)


def _table(llama, length: int, cluster: str = "2xcpu"):
    gm, ctx = llama
    return build_cost_table(gm, ctx.layers, cluster, length, seq_symbol=ctx.seq_symbol,
                            token_count=ctx.token_count)


def _fresh(expr: sympy.Expr, seq_len: int):
    """The uncached compile: substitute L, then lambdify over (c, p)."""
    raw = to_numpy(expr.subs(L, seq_len), (C, P))

    def time(c, p):
        c, p = np.asarray(c, dtype=float), np.asarray(p, dtype=float)
        shape = np.broadcast_shapes(c.shape, p.shape)
        return np.broadcast_to(np.asarray(raw(c, p), dtype=float), shape).copy()

    return time


def _grid(length: int) -> tuple[np.ndarray, np.ndarray]:
    c, p = np.meshgrid(np.linspace(1, length, 9), np.linspace(0, length - 1, 7))
    return c.ravel(), p.ravel()


@pytest.mark.parametrize("model", ["llama", "dit"])
def test_a_layer_time_compiled_once_equals_a_fresh_compile_at_every_length(model, request):
    gm, ctx = request.getfixturevalue(model)
    _table((gm, ctx), 64)  # compiles every distinct layer time
    misses = compiled_times._compiled.cache_info().misses
    device = Cluster.parse("2xcpu").devices[0]
    for length in LENGTHS:
        table = _table((gm, ctx), length)
        exprs = layer_expressions(gm, ctx.layers, device, length,
                                  seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
        c, p = _grid(length)
        for layer, expr in zip(table.layers[0], exprs, strict=True):
            want = sympy.lambdify((C, P), expr.time, modules=[NUMPY_NAMESPACE,
                                                                "numpy"])(c, p)
            np.testing.assert_allclose(layer.time(c, p), want, rtol=1e-12, atol=0)
        assert table.layers[0][1].time(c, p).max() > 0
    if model == "dit":  # its attention reads all L keys: a stale L would show
        c, p = np.array([16.0]), np.array([0.0])
        short, long = (_table((gm, ctx), n).layers[0] for n in (64, 4096))
        assert any(a.time(c, p)[0] < b.time(c, p)[0] for a, b in zip(short, long))
    assert compiled_times._compiled.cache_info().misses == misses  # no compile per length


def test_cached_and_fresh_tables_give_the_same_plans(llama, monkeypatch):
    # a deadline far beyond the search: the plans depend on the tables, never on the clock
    cached = {n: plan_any_length(lambda t: _table(llama, t), n, time_limit=600) for n in LENGTHS}
    monkeypatch.setattr(layer_pricer, "vectorise", _fresh)
    for n, plan in cached.items():
        fresh = plan_any_length(lambda t: _table(llama, t), n, time_limit=600)
        assert fresh.boundaries == plan.boundaries
        assert [(s.device_index, s.layer_names) for s in fresh.stages] == \
            [(s.device_index, s.layer_names) for s in plan.stages]
        assert fresh.latency == pytest.approx(plan.latency, rel=1e-12)
        assert fresh.lower_bound == pytest.approx(plan.lower_bound, rel=1e-12)


def test_tables_built_in_threads_equal_tables_built_one_by_one(llama):
    compiled_times._compiled.cache_clear()  # every thread misses at once
    lengths = (100, 3001, 20000, 77)
    got: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(lengths))

    def build(n: int) -> None:
        barrier.wait()
        table = _table(llama, n, "1xh100-sxm+1xcpu")
        got[n] = table.times_at(n, 0.0)

    threads = [threading.Thread(target=build, args=(n,)) for n in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in lengths:
        np.testing.assert_array_equal(got[n], _table(llama, n, "1xh100-sxm+1xcpu").times_at(n, 0.0))
