"""THE greedy decode loop (``tppc.generation.greedy_decode``): the same code on torch tensors
and numpy arrays picks the tokens a hand-written argmax picks, and stops by HF's rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tppc.artifact.core.loaded import NUMPY_OPS
from tppc.generation import greedy_decode
from tppc.pipeline.generate import TORCH_OPS

BATCH, PROMPT, VOCAB, NEW = 3, 4, 9, 6


def _logit_steps(seed: int) -> list[np.ndarray]:
    """The logits each step returns: the prefill's ``(batch, prompt, vocab)`` (only its last
    position counts), then one position per decoding step."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, PROMPT if k == 0 else 1, VOCAB)).astype(np.float32)
            for k in range(NEW)]


def _by_hand(steps: list[np.ndarray], eos: list[int], pad: int | None) -> list[list[int]]:
    """The oracle: argmax with Python loops, HF's rule for ended rows, stop when all ended."""
    rows: list[list[int]] = [[] for _ in range(BATCH)]
    ended = [False] * BATCH
    for logits in steps:
        for b in range(BATCH):
            last = [float(x) for x in logits[b, -1]]
            token = max(range(VOCAB), key=lambda v: last[v])
            rows[b].append(pad if ended[b] and pad is not None else token)
            ended[b] = ended[b] or rows[b][-1] in eos
        if all(ended):
            break
    return rows


def _decode_numpy(steps: list[np.ndarray], eos: list[int], pad: int | None,
                  share=None, has_logits: bool = True) -> np.ndarray:
    ids = np.zeros((BATCH, PROMPT + NEW), dtype=np.int64)
    ids[:, :PROMPT] = 1
    length = greedy_decode(ids, PROMPT, lambda n: steps[n - PROMPT] if has_logits else None,
                           NUMPY_OPS, eos_ids=eos, pad=pad, share=share)
    return ids[:, :length]


def _decode_torch(steps: list[np.ndarray], eos: list[int], pad: int | None) -> torch.Tensor:
    ids = torch.ones(BATCH, PROMPT + NEW, dtype=torch.int64)
    ids[:, PROMPT:] = 0
    length = greedy_decode(ids, PROMPT, lambda n: torch.from_numpy(steps[n - PROMPT]),
                           TORCH_OPS, eos_ids=eos, pad=pad)
    return ids[:, :length]


def _eos_of(steps: list[np.ndarray]) -> list[int]:
    """An EOS id that row 0 produces at its second new token (so rows end at different
    steps, some never)."""
    return [int(steps[1][0, -1].argmax())]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("stop", ["none", "eos+pad", "eos, no pad"])
def test_torch_and_numpy_pick_the_tokens_a_hand_argmax_picks(seed: int, stop: str) -> None:
    steps = _logit_steps(seed)
    eos = [] if stop == "none" else _eos_of(steps)
    pad = 0 if stop == "eos+pad" else None
    want = _by_hand(steps, eos, pad)
    got_np = _decode_numpy(steps, eos, pad)
    got_torch = _decode_torch(steps, eos, pad)
    assert got_np[:, PROMPT:].tolist() == want
    assert got_torch[:, PROMPT:].tolist() == want
    assert (got_np[:, :PROMPT] == 1).all() and bool((got_torch[:, :PROMPT] == 1).all())


def test_decoding_stops_when_every_row_has_ended() -> None:
    steps = [np.zeros((BATCH, 1, VOCAB), np.float32) for _ in range(NEW)]
    for logits in steps:
        logits[:, -1, 5] = 1.0  # every row picks 5 at once
    calls: list[int] = []

    def step(n: int) -> np.ndarray:
        calls.append(n)
        return steps[n - PROMPT]

    ids = np.zeros((BATCH, PROMPT + NEW), dtype=np.int64)
    assert greedy_decode(ids, PROMPT, step, NUMPY_OPS, eos_ids=[5], pad=0) == PROMPT + 1
    assert calls == [PROMPT]  # the prefill only: no step after every row ended


def test_a_rank_without_logits_writes_the_shared_token() -> None:
    """A job: the last rank picks, ``share`` broadcasts; the other ranks' steps return None
    and their ids equal the last rank's."""
    steps = _logit_steps(11)
    eos = _eos_of(steps)
    picked: list[np.ndarray] = []

    def broadcast_from_last(token: np.ndarray) -> np.ndarray:
        picked.append(np.asarray(token).copy())
        return picked[-1]

    last = _decode_numpy(steps, eos, 0, share=broadcast_from_last)
    sent = iter(picked)
    other = _decode_numpy(steps, eos, 0, share=lambda token: next(sent), has_logits=False)
    np.testing.assert_array_equal(other, last)
    assert last[:, PROMPT:].tolist() == _by_hand(steps, eos, 0)
