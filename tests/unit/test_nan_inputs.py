"""A NaN in a floating input is refused by name on every path (issue 19's crash list).

Why refuse rather than run: eager masked attention multiplies a masked probability (0) by a
value row, so one NaN at position p reaches every position (0 x NaN = NaN), while a chunk
never reads a later chunk's rows, so the pipeline keeps the chunks before p finite. The first
test shows that the two patterns differ (so a refusal is needed, not a nicety); the others
check the refusal on the torch path, on ``generate``-free LLM embeddings and on an exported
artifact, and that finite inputs (infinities included, as an additive mask holds -inf) pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tppc
from tppc.artifact.core.check import check_finite
from tppc.errors import RuntimeInputError
from tppc.examples import dit, hf_llama

SEQ = 32


@pytest.fixture(scope="module")
def llama():
    model, args, _ = hf_llama(seq_len=SEQ)
    with torch.no_grad():
        emb = model.model.embed_tokens(args[0])
        cp = tppc.compile(model, (), {"inputs_embeds": emb}, cluster="2xcpu", chunks=4)
    return model, emb, cp


def test_eager_and_chunks_spread_a_nan_differently(llama) -> None:
    """The reason for the refusal: eager's NaN reaches positions before it, chunks' does not."""
    model, emb, _ = llama
    x = emb.clone()
    x[0, 20, 3] = float("nan")
    with torch.no_grad():
        eager = model(inputs_embeds=x).logits.isnan().any(-1)[0]
        first_chunk = model(inputs_embeds=x[:, :8]).logits.isnan().any(-1)[0]
    assert bool(eager[:8].all()), "eager spreads the NaN to every position"
    assert not bool(first_chunk.any()), "a chunk before the NaN never sees it"


def test_a_nan_in_embeddings_is_refused_with_its_index(llama) -> None:
    model, emb, cp = llama
    x = emb.clone()
    x[0, 20, 3] = float("nan")
    with pytest.raises(RuntimeInputError, match=r"input 'inputs_embeds' holds NaN \(first at "
                       r"index \(0, 20, 3\), 1 in all\).*fix: replace NaN"):
        cp(inputs_embeds=x)
    with torch.no_grad():
        want = model(inputs_embeds=emb).logits
        got = cp(inputs_embeds=emb)
    got = got.logits if hasattr(got, "logits") else got[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_nan_in_a_latent_is_refused_and_infinities_pass() -> None:
    model, args, _ = dit()
    with torch.no_grad():
        cp = tppc.compile(model, args, cluster="2xcpu")
        x = args[0].clone()
        x[0, 1, 3, 5] = float("nan")
        with pytest.raises(RuntimeInputError, match=r"input 'x' holds NaN \(first at index "
                           r"\(0, 1, 3, 5\)"):
            cp(x, *args[1:])
        x[0, 1, 3, 5] = float("inf")
        out = cp(x, *args[1:])
    assert out.shape == model(x, *args[1:]).shape


def test_the_artifact_runner_refuses_a_nan_like_torch(llama, tmp_path) -> None:
    _, emb, cp = llama
    tppc.export(cp, tmp_path)
    runner = tppc.load(tmp_path)
    x = emb.numpy().copy()
    x[0, 3, 1] = np.nan
    with pytest.raises(RuntimeInputError, match=r"input 'inputs_embeds' holds NaN \(first at "
                       r"index \(0, 3, 1\), 1 in all\).*numpy.nan_to_num"):
        runner(inputs_embeds=x)
    check_finite("ids", np.arange(6).reshape(2, 3))  # integer inputs are not looked at
