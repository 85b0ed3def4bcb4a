"""The probe length of translation validation (:func:`tppc.validation.validate.probe_length`).

``max_seq`` counts tokens; a block capture's lengths count blocks of ``k`` tokens
(``ctx.block_size``), so a probe of ``n`` blocks is ``n · k`` tokens against ``max_seq``.
"""

from __future__ import annotations

from types import SimpleNamespace

from tppc.validation.validate import probe_length


def _at(block_size: int | None, max_seq: int | None, granularity: int = 1
        ) -> tuple[SimpleNamespace, SimpleNamespace]:
    front = SimpleNamespace(ctx=SimpleNamespace(capture_mode="dynamic", block_size=block_size))
    cp = SimpleNamespace(plan=SimpleNamespace(granularity=granularity),
                         options=SimpleNamespace(max_seq=max_seq))
    return front, cp


def test_a_block_probe_is_bounded_by_max_seq_in_tokens() -> None:
    # an example of 2 blocks of 4: the probe is 3 blocks = 12 tokens, over max_seq=8 tokens
    # (it was compared as 3 with 8, and validation ran a length the pipeline refuses)
    assert probe_length(*_at(4, 8), 2) == (
        None, "no probe length: 3 blocks of 4 = 12 tokens is over max_seq=8")
    assert probe_length(*_at(4, 12), 2) == (3, "")  # 12 tokens: within


def test_a_token_probe_is_bounded_by_max_seq_in_tokens() -> None:
    assert probe_length(*_at(None, 8), 2) == (3, "")
    assert probe_length(*_at(None, 2), 2) == (None, "no probe length: 3 is over max_seq=2")
    assert probe_length(*_at(None, None, granularity=2), 8) == (6, "")  # shorter: no bound
