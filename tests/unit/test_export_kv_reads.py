"""K/V read through views at export (:mod:`tppc.artifact.writer.kv_reads`): the identity and
a repetition of heads are recognised, a chain that moves tokens is not."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from torch import fx

from tppc.artifact.writer.kv_reads import buffer_read
from tppc.ir.records import CHUNK_INPUT

_aten = torch.ops.aten


def _read(chain: Callable[[fx.Graph, fx.Node, fx.Node], fx.Node]):
    """A buffer ``(1, 2, tokens, 4)`` read ``[0, n)``, then ``chain``; the read found."""
    graph = fx.Graph()
    buffer = graph.placeholder("kb")
    buffer.meta[CHUNK_INPUT] = types.SimpleNamespace(shape=(1, 2, None, 4))
    n = graph.placeholder("kv_len")
    narrow = graph.call_function(_aten.narrow.default, (buffer, 2, 0, n))
    return narrow, buffer_read(chain(graph, narrow, n), {"kb"})


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    return graph.call_function(target, args)


def test_a_round_trip_of_reshapes_is_the_identity() -> None:  # Bloom's (b·h, t, d)
    narrow, read = _read(lambda g, x, n: _call(g, _aten.reshape.default,
                                               _call(g, _aten.reshape.default, x, [2, -1, 4]),
                                               [1, 2, n, 4]))
    assert read is not None and read.narrow is narrow and read.group == 1


def test_repeat_kv_is_a_repetition_of_heads() -> None:  # transformers' repeat_kv
    def repeat(g: fx.Graph, x: fx.Node, n: fx.Node) -> fx.Node:
        wide = _call(g, _aten.expand.default, _call(g, _aten.unsqueeze.default, x, 2),
                     [1, 2, 3, n, 4])
        return _call(g, _aten.reshape.default, _call(g, _aten.clone.default, wide),
                     [1, 6, n, 4])
    _, read = _read(repeat)
    assert read is not None and read.group == 3


@pytest.mark.parametrize("chain", [
    lambda g, x, n: _call(g, _aten.transpose.int, x, 2, 3),            # not a view op
    lambda g, x, n: _call(g, _aten.reshape.default, x, [1, 2, 4, n]),   # tokens ↔ channels
    lambda g, x, n: _call(g, _aten.expand.default, _call(g, _aten.unsqueeze.default, x, 3),
                          [1, 2, n, 2, 4]),                              # tokens repeated
    lambda g, x, n: _call(g, _aten.mul.Tensor, x, 2.0),                  # a computation
], ids=["transpose", "tokens_into_channels", "tokens_repeated", "mul"])
def test_other_chains_are_not_buffer_reads(chain) -> None:
    assert _read(chain)[1] is None
