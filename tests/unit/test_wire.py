"""The one wire format between ranks (``tppc.backends.wire``): JSON header + raw bytes, no
pickle. Round trips through the encoder and decoder, and through a real 2-rank gloo job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tppc.backends import wire
from tppc.errors import RuntimeInputError, StageFailed

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
SHAPES = [(), (0,), (3, 0, 2), (2, 5), (1, 3, 4)]


def _value(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g,
                         dtype=dtype)


def _transfer(tree):
    """Encode ``tree``, decode its header, allocate and fill the buffers from the payload as
    the receiving rank does (its bytes, through flat uint8 views)."""
    header, payload = wire.encode(tree)
    json.loads(header)  # the header is plain JSON
    filled, buffers = wire.allocate(wire.decode(header))
    assert len(buffers) == len(payload)
    for buf, value in zip(buffers, payload):
        wire.byte_view(buf).copy_(wire.byte_view(value))
    return filled


def _equal(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensors_round_trip_with_dtype_shape_and_bytes(dtype, shape) -> None:
    value = _value(dtype, shape)
    _equal(_transfer([value]), [value])


def test_a_tree_of_values_round_trips() -> None:
    tree = {"args": (torch.arange(6).reshape(2, 3), None),
            "kwargs": {"mask": torch.ones(2, 3, dtype=torch.bool), "n": 7, "x": 0.25,
                       "name": "timestep", "flag": False, "empty": torch.empty(0, 4)},
            "ints": [1, -2, 3], 4: (), "array": np.arange(5, dtype=np.float16),
            "bools": np.array([True, False])}
    _equal(_transfer(tree), tree)


def test_non_contiguous_tensors_travel_as_their_values() -> None:
    value = torch.arange(12.0).reshape(3, 4).t()
    _equal(_transfer(value), value.contiguous())


def test_values_without_a_wire_form_are_refused_naming_where() -> None:
    with pytest.raises(RuntimeInputError, match=r"value\[1\]\['cache'\] is a object"):
        wire.encode(({}, {"cache": object()}))
    with pytest.raises(RuntimeInputError, match="value is a ndarray"):
        wire.encode(np.array([object()]))


@pytest.mark.parametrize("header", [
    b'{"tensor": ["Tensor", [2], "cpu"]}',          # not a dtype
    b'{"tensor": ["float32", [-1], "cpu"]}',         # negative size
    b'{"array": ["O", [2]]}',                        # object arrays never travel
    b'{"tensor": ["float32", [2], "meta"]}',         # unknown device
    b'{"pickle": "gASVAAAA"}',                       # unknown tag
    b"\x80\x04\x95",                                 # a pickle, not JSON
])
def test_headers_not_written_by_encode_are_refused(header: bytes) -> None:
    with pytest.raises(StageFailed, match="wire header"):
        wire.decode(header)


_RANK = textwrap.dedent("""
    import os, sys, torch, numpy as np
    import torch.distributed as dist
    from datetime import timedelta
    from tppc.backends import wire
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    def tree():
        g = torch.Generator().manual_seed(3)
        return {"x": torch.randn(2, 3, generator=g).to(torch.bfloat16),
                "mask": torch.rand(4, generator=g) > 0.5, "empty": torch.empty(0, 2),
                "ids": np.arange(6, dtype=np.int32).reshape(2, 3), "n": 5, "none": None,
                "t": (1.5, "s")}
    wait = timedelta(seconds=60)
    if rank == 1:
        wire.send(tree(), 0)
        got = wire.broadcast(None, 0)
    else:
        got = wire.recv(1, "cpu", wait)
        wire.broadcast(got, 0)
    want = tree()
    assert list(got) == list(want)
    for k in want:
        a, b = got[k], want[k]
        assert type(a) is type(b), (k, type(a))
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
        elif isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and (a == b).all(), k
        else:
            assert a == b, k
    print("ok", rank)
    dist.destroy_process_group()
""")


def test_send_recv_and_broadcast_between_two_gloo_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.strip() == f"ok {r}", err[-2000:]
