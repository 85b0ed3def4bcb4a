"""The memory check of ``generate`` (:mod:`tppc.calls.kv_memory`) on a block capture.

A block capture's buffers hold whole blocks of ``k`` tokens; the refusal says so and bounds
``max_new_tokens`` in tokens. The numbers are computed by hand from the buffers' shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tppc.calls.kv_memory import check_generation_memory
from tppc.errors import RuntimeInputError
from tppc.program.program import BufferSpec

K = 4


def _block_capture() -> tuple[SimpleNamespace, SimpleNamespace, tuple[torch.Tensor]]:
    """One stage on the CPU: a float32 K buffer of 8 channels (``K`` rows per block: 128
    bytes a block) and a float32 state of 8 (32 bytes, any length); int64 ids (8 bytes a
    token, 32 a block): 160 bytes a block and 32 more."""
    keys = BufferSpec("k", "key", "sdpa", "layers.0", 1, (1, None, 8), torch.float32, scale=K)
    state = BufferSpec("s", "state", "scan", "layers.0", None, (1, 8), torch.float32)
    program = SimpleNamespace(stages=[SimpleNamespace(device=torch.device("cpu"),
                                                      buffers=(keys, state))])
    front = SimpleNamespace(signature=SimpleNamespace(user_inputs=("input_ids",)),
                            ctx=SimpleNamespace(seq_inputs={"input_ids": (1,)}))
    return program, front, (torch.zeros(1, 12, dtype=torch.long),)


def test_a_block_generation_is_refused_in_blocks_with_a_bound_in_tokens(monkeypatch) -> None:
    monkeypatch.setattr("tppc.calls.kv_memory.free_bytes", lambda device: 2**20)
    program, front, flat = _block_capture()
    with pytest.raises(RuntimeInputError) as info:
        check_generation_memory(program, front, flat, 10, 10**9, block=K)
    message = str(info.value)
    # 10 + 10**9 tokens: ⌈1000000010 / 4⌉ = 250000003 blocks, 160 bytes each, + 32
    need = (250000003 * 160 + 32) / 2**30
    assert (f"10 prompt tokens + max_new_tokens=1000000000 = 1000000010 tokens, held as "
            f"250000003 blocks of 4 = 1000000012 tokens, need {need:,.1f} GiB on cpu") \
        in message, message
    # 1 MiB holds 6553 blocks (6553 · 160 + 32 = 1048512 bytes; one more: 1048672):
    # 6553 · 4 − 10 = 26202 new tokens
    assert "fix: lower max_new_tokens to at most 26202" in message, message
    check_generation_memory(program, front, flat, 10, 26202, block=K)  # it fits
    with pytest.raises(RuntimeInputError):
        check_generation_memory(program, front, flat, 10, 26202 + K, block=K)


def test_a_loaded_block_generation_is_refused_before_its_ids_grow(monkeypatch) -> None:
    # the loaded artifact's generate (numpy buffers in host memory) had no check: its ids
    # grew to 10**9 tokens first. One stage of 128 bytes a block (K rows) and 32 (a state);
    # int64 ids of batch 1: 32 bytes a block. The same numbers as the torch check above.
    from tppc.artifact.core.generate_inputs import check_memory

    monkeypatch.setattr("tppc.calls.kv_memory.host_free_bytes", lambda: 2**20)
    stage = SimpleNamespace(buffer_bytes=lambda units: 128 * units + 32)
    ids = np.zeros((1, 10), dtype=np.int64)
    with pytest.raises(RuntimeInputError) as info:
        check_memory([stage], ids, 10**9, K)
    need = (250000003 * 160 + 32) / 2**30
    assert (f"10 prompt tokens + max_new_tokens=1000000000 = 1000000010 tokens, held as "
            f"250000003 blocks of 4 = 1000000012 tokens, need {need:,.1f} GiB on cpu") \
        in str(info.value)
    assert "fix: lower max_new_tokens to at most 26202" in str(info.value)
    check_memory([stage], ids, 26202, K)  # it fits
    with pytest.raises(RuntimeInputError):
        check_memory([stage], ids, 26202 + K, K)


def _ranks(*hosts: int):
    """A rank of a job whose ranks run on ``hosts`` (rank ``r`` on ``hosts[r]``), every one
    with this rank's need and free memory (what ``gather_ints`` gathers)."""
    def gather(row):
        return [[host, *row[1:]] for host in hosts]

    return SimpleNamespace(device=torch.device("cpu"), gather_ints=gather)


def test_ranks_of_one_host_are_charged_together(monkeypatch) -> None:
    # the CPU ranks of one host share its RAM: 10 + 20000 tokens = 5003 blocks fit one
    # rank's 160 bytes a block (+ 32) in 1 MiB, not two ranks' (320 a block + 64)
    from tppc.distributed.generate import check_rank_memory

    monkeypatch.setattr("tppc.calls.kv_memory.host_free_bytes", lambda: 2**20)
    program, front, flat = _block_capture()
    check_rank_memory(_ranks(7), program, front, flat, 10, 20000, block=K)
    check_rank_memory(_ranks(7, 8), program, front, flat, 10, 20000, block=K)  # two hosts
    with pytest.raises(RuntimeInputError) as info:
        check_rank_memory(_ranks(7, 7), program, front, flat, 10, 20000, block=K)
    # 1 MiB holds 3276 blocks of both ranks (3276 · 320 + 64 = 1048384; one more: 1048704):
    # 3276 · 4 − 10 = 13094 new tokens
    assert "held as 5003 blocks of 4 = 20012 tokens, need 0.0 GiB on cpu of ranks 0, 1" \
        in str(info.value), str(info.value)
    assert "fix: lower max_new_tokens to at most 13094" in str(info.value)
