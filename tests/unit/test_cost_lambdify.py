"""Cost expressions with torch's shape functions evaluate in numpy (DiTs: FloorDiv...)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from torch.utils._sympy import functions as tf

from tppc.cost_models.lambdify import to_numpy

c = sympy.Symbol("c", positive=True, integer=True)
CASES = [  # expression, the same computed by hand in Python for one value of c
    (tf.FloorDiv(c, 3), lambda v: v // 3),
    (tf.CeilDiv(c, 3), lambda v: -(-v // 3)),
    (tf.ModularIndexing(c, 2, 5), lambda v: (v // 2) % 5),
    (tf.PythonMod(c, 7), lambda v: v % 7),
    (tf.Max(c, 9), lambda v: max(v, 9)),
    (tf.Min(c, 9), lambda v: min(v, 9)),
    (sympy.Max(c * 2, 9), lambda v: max(2 * v, 9)),
    (tf.FloorDiv(c, 2) ** 2 * 4 + sympy.ceiling(c / 128) * 128, lambda v: (v // 2) ** 2 * 4
     + -(-v // 128) * 128),
]


@pytest.mark.parametrize(("expr", "by_hand"), CASES, ids=[str(e) for e, _ in CASES])
def test_torch_shape_functions_evaluate_like_python(expr, by_hand) -> None:
    fn = to_numpy(expr, (c,))
    values = np.array([1.0, 2.0, 7.0, 8.0, 129.0, 1000.0])
    got = np.broadcast_to(np.asarray(fn(values), dtype=float), values.shape)
    assert got.tolist() == [float(by_hand(int(v))) for v in values]


def test_plan_of_a_diffusers_dit_runs(capsys) -> None:
    pytest.importorskip("diffusers")
    from tppc.cli.main import main

    assert main(["plan", "tppc.examples:hf_dit", "--cluster", "4xa100-80gb"]) == 0
    assert "predicted latency" in capsys.readouterr().out
