"""Block scans: a sequence padded to whole blocks of ``k`` rows with a recurrence over the blocks.

Captured with the length ``k × blocks`` (the padding symbolically empty), so a unit of the plan
is one block and every chunk boundary a multiple of ``k``; the recurrence over the blocks is
carried from chunk to chunk on its stage (a scan over the blocks axis as any scan; Mamba2's
form, an initial-state slot ``cat([zeros, states])`` and ``whole[:, :-1]``, as one region
with a state buffer). Models of our own in two forms (a prefix sum carried across blocks by
``cumsum``; a decayed recurrence through an ``(n+1) × (n+1)`` decay matrix with a state of
``(batch, 1, channels)``) and transformers' ``Mamba2ForCausalLM`` (state ``(batch, 1, heads,
head_dim, state)``), each against eager at 2 stages with chunks of one block, at a re-planned
length, and through the exported artifact (``tppc.load``: each stage's block states carried
between its ONNX chunk sessions); lengths that are no whole number of blocks refused by name.
Greedy ``generate`` (:mod:`tppc.pipeline.block_generate`: each decode step re-runs its current
block with filler rows and puts the carried states back until the block completes) equals a
manual eager greedy loop token for token, in torch and through the loaded artifact, for token
models of our own (the decayed slots, and a new form: a causal convolution then block-wise
linear attention with a ``(batch, heads, d, d)`` matrix state carried across blocks by a scan),
Mamba2 and Falcon-H1, at prompts of less than a block, of whole blocks and with a tail.

Tolerance: float32 reassociation only (:func:`assert_kernels_close`): a chunk applies the
carried state's decay as ``exp`` of a sum over its own blocks, the whole graph over the prefix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.integration.block_models import falcon_h1
from tests.oracles import assert_kernels_close
from tppc.planner.manual import manual_plan

K, D = 4, 6


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    b, n, d = x.shape
    return F.pad(x, (0, 0, 0, (K - n % K) % K)).reshape(b, -1, K, d)


class _PrefixBlocks(nn.Module):
    """A prefix sum by blocks: summed inside each block, carried across blocks by cumsum."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            h = lin(x)
            n = h.shape[1]
            blocks = _pad_blocks(h)
            totals = blocks.sum(2)
            carried = totals.cumsum(1) - totals
            x = x + (blocks.cumsum(2) + carried[:, :, None]).reshape(x.shape[0], -1, D)[:, :n]
        return x


class _DecayedSlots(nn.Module):
    """``h_t = a_t · h_{t−1} + u_t`` per channel, by blocks: within a block from zero, across
    blocks through an initial-state slot and an ``(n+1) × (n+1)`` decay matrix (Mamba2's
    form, with a state of ``(batch, 1, channels)`` instead of Mamba2's per-head matrices)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            x = x + self._mix(lin(x))
        return self.out(x)

    @staticmethod
    def _mix(x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        u = _pad_blocks(x)
        cum = (-F.softplus(u)).cumsum(2)                         # log decay inside a block
        inner = torch.exp(cum) * (torch.exp(-cum) * u).cumsum(2)  # from a zero state
        last = inner[:, :, -1]
        slots = torch.cat([torch.zeros_like(last[:, :1]), last], dim=1)
        t = F.pad(cum[:, :, -1], (0, 0, 1, 0))
        m = t.shape[1]
        below = torch.tril(torch.ones(m, m, dtype=torch.bool), -1)[None, :, :, None]
        seg = t[:, :, None, :].expand(b, m, m, d).masked_fill(~below, 0).cumsum(1)
        upper = ~torch.tril(torch.ones(m, m, dtype=torch.bool))[None, :, :, None]
        h = torch.einsum("bczd,bzd->bcd", torch.exp(seg.masked_fill(upper, float("-inf"))),
                         slots)
        y = inner + torch.exp(cum) * h[:, :-1, None]
        return y.reshape(b, -1, d)[:, :n]


class _ConvLinear(nn.Module):
    """A causal depthwise convolution (kernel 3), then linear attention by blocks: causal
    ``(q kᵀ) v`` inside a block, and a ``(heads, d, d)`` matrix state ``Σ kᵀ v`` of the blocks
    before it, carried across the blocks by a scan over them."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.conv = nn.Conv1d(D, D, 3, padding=2, groups=D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = F.silu(self.conv(x.transpose(1, 2))[..., :n].transpose(1, 2))
        q, k, v = (_pad_blocks(t).unflatten(-1, (self.heads, -1))
                   for t in self.qkv(h).chunk(3, -1))            # (b, blocks, K, heads, d)
        causal = torch.tril(torch.ones(K, K, dtype=torch.bool))
        scores = torch.einsum("bcihd,bcjhd->bchij", q, k).masked_fill(~causal, 0)
        inner = torch.einsum("bchij,bcjhd->bcihd", scores, v)
        kv = torch.einsum("bcjhd,bcjhe->bchde", k, v)            # each block's Σ kᵀ v
        cross = torch.einsum("bcihd,bchde->bcihe", q, kv.cumsum(1) - kv)
        return x + self.out((inner + cross).flatten(-2).reshape(b, -1, D)[:, :n])


class _ConvLinearBlocks(nn.Module):
    """Two :class:`_ConvLinear` layers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ConvLinear() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.blocks:
            x = layer(x)
        return x


class _TokenLM(nn.Module):
    """Token ids → embedding → a block scan body → logits (what ``generate`` decodes)."""

    def __init__(self, body: nn.Module, vocab: int = 32) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(vocab, D), body, nn.Linear(D, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(input_ids)))


def _eager_greedy(model: nn.Module, ids: torch.Tensor, new: int, **kwargs) -> torch.Tensor:
    """Greedy decoding by re-running the whole sequence eagerly per token (the reference)."""
    with torch.no_grad():
        for _ in range(new):
            out = model(ids, **kwargs)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _sequential(x: torch.Tensor) -> torch.Tensor:
    """``_DecayedSlots._mix`` step by step (the recurrence it computes)."""
    a, h, rows = torch.exp(-F.softplus(x)), torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        rows.append(h)
    return torch.stack(rows, 1)


@pytest.fixture(scope="module", params=[_PrefixBlocks, _DecayedSlots])
def own(request: pytest.FixtureRequest) -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = request.param().eval()
    cp = tppc.compile(model, (torch.randn(1, 16, D),), seq_dims={"x": 1}, num_stages=2)
    return model, cp


def test_decayed_slots_compute_the_recurrence() -> None:
    x = torch.randn(2, 13, D)
    assert_kernels_close(_DecayedSlots._mix(x), _sequential(x))


def test_own_block_scans_are_exact_in_chunks_of_blocks(own) -> None:
    model, cp = own
    assert cp.context.block_size == K
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 4, 6)))
    x = torch.randn(2, 6 * K, D)
    with torch.no_grad():
        assert_kernels_close(staged(x), model(x))
        y = torch.randn(2, 10 * K, D)  # re-planned
        assert_kernels_close(cp(y), model(y))


def test_a_block_plan_counts_tokens_k_to_a_unit(own) -> None:
    # the planner prices and names tokens (a memory refusal: "chunks of up to 4 tokens"),
    # a unit being one block of k; it counted blocks as tokens
    _, cp = own
    assert (cp.plan.tokens_per_unit, cp.plan.seq_len, cp.plan.seq_tokens) == (K, 4, 4 * K)
    assert (cp.plan.blocks, cp.plan.unit) == (True, f"blocks of {K} tokens")  # not patch rows
    assert f"seq_len=4 blocks of {K} tokens ({4 * K} tokens)" in cp.plan.summary()


def test_lengths_of_no_whole_blocks_are_refused_by_name(own) -> None:
    _, cp = own
    with pytest.raises(tppc.RuntimeInputError, match=r"has 10 tokens.*multiple of 4.*fix: "
                       r"pass 12 tokens"):
        cp(torch.randn(1, 10, D))


def test_block_example_of_no_whole_blocks_is_refused_at_capture() -> None:
    with pytest.raises(tppc.CaptureError, match=r"example sequence of 6 tokens is padded.*"
                       r"multiple of 4.*fix: capture with an example of 2 × 4 = 8 tokens"):
        tppc.capture(_PrefixBlocks(), (torch.randn(1, 6, D),), seq_dims={"x": 1})


@pytest.fixture(scope="module", params=[_DecayedSlots, _ConvLinearBlocks])
def own_lm(request: pytest.FixtureRequest) -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _TokenLM(request.param()).eval()
    return model, tppc.compile(model, (torch.randint(0, 32, (2, 4 * K)),), num_stages=2)


def test_own_block_scans_generate_as_eager(own_lm) -> None:
    # prompts of less than a block, of a block and a tail, of whole blocks (a pipelined
    # prefill); 7 new tokens cross block boundaries: steps that put the states back and steps
    # that complete a block and keep them
    model, cp = own_lm
    states = {b.shape for st in cp.program(4).stages for b in st.buffers if b.kind == "state"}
    if isinstance(model.body, _ConvLinearBlocks):  # the conv's 2 rows; the matrix state
        assert {(2, 2, D, 2), (2, 2, 1, 2, 3, 3)} <= states, states
    for prompt in (1, K + 2, 2 * K):
        ids = torch.randint(0, 32, (2, prompt))
        assert torch.equal(cp.generate(ids, max_new_tokens=7), _eager_greedy(model, ids, 7))


def test_block_generation_past_the_memory_is_refused_counting_blocks(own_lm) -> None:
    # the buffers hold whole blocks: the refusal counts the tokens and the blocks holding them
    _, cp = own_lm
    with pytest.raises(tppc.RuntimeInputError, match=r"^6 prompt tokens \+ max_new_tokens="
                       r"100000000000 = 100000000006 tokens, held as 25000000002 blocks of 4 = "
                       r"100000000008 tokens, need [\d,.]+ GiB on cpu"):
        cp.generate(torch.randint(0, 32, (2, 6)), max_new_tokens=10**11)


def test_exported_block_scans_generate_as_eager(own_lm, tmp_path) -> None:
    # the loaded artifact's generate: the prefill pipelined at an exported length (6 blocks),
    # as one chunk of whole blocks otherwise, then block steps on its numpy state buffers
    model, cp = own_lm
    n = len(cp.context.layers)
    tppc.export(cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 2, 4, 6))),
                tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    for prompt in (3, 6 * K, 6 * K + 1):
        ids = torch.randint(0, 32, (2, prompt))
        got = runner.generate(ids.numpy(), max_new_tokens=5)
        assert (got == _eager_greedy(model, ids, 5).numpy()).all()
    # refused before the ids grow (it tried to allocate 1.6 TB of ids), as cp.generate does
    with pytest.raises(tppc.RuntimeInputError, match=r"^6 prompt tokens \+ max_new_tokens="
                       r"100000000000 = 100000000006 tokens, held as 25000000002 blocks of 4 = "
                       r"100000000008 tokens, need [\d,.]+ GiB on cpu"):
        runner.generate(ids[:, :6].numpy(), max_new_tokens=10**11)


@pytest.fixture(scope="module")
def mamba2() -> tuple[nn.Module, tppc.CompiledPipeline]:
    transformers = pytest.importorskip("transformers")
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=8, state_size=2, num_heads=2,
                                       head_dim=8, n_groups=1, expand=2, num_hidden_layers=2,
                                       chunk_size=K, conv_kernel=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 4 * K))
    return model, tppc.compile(model, (ids,), {"use_cache": False}, num_stages=2)


def test_mamba2_is_exact_in_chunks_of_blocks_and_in_generate(mamba2) -> None:
    model, cp = mamba2
    n = len(cp.context.layers)
    states = [b for st in cp.program(6).stages for b in st.buffers if b.kind == "state"]
    # per layer: the short convolution's rows, and the SSD state between blocks
    assert sorted({b.shape for b in states}) == [(2, 1, 1, 2, 8, 2), (2, 1, 20, 1)]
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 4, 6)))
    with torch.no_grad():
        for run, length in ((staged, 6 * K), (cp, 10 * K)):
            ids = torch.randint(0, 64, (2, length))
            assert_kernels_close(run(ids, use_cache=False).logits,
                                 model(ids, use_cache=False).logits)
    # within a block, whole blocks, a block and a tail (whose greedy tokens differ when the
    # states are not put back after the steps of an incomplete block)
    for ids in (torch.randint(0, 64, (1, 3)), torch.randint(0, 64, (1, 2 * K)),
                torch.tensor([[41, 60, 11, 40, 29, 49]])):
        want = _eager_greedy(model, ids, 9, use_cache=False)
        assert torch.equal(cp.generate(ids, max_new_tokens=9), want)
        # transformers' own decode (its recurrent step on the cache) agrees
        assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=9, do_sample=False,
                                          eos_token_id=None, pad_token_id=0), want)


def test_exported_block_states_equal_eager_in_chunks_of_blocks(own, tmp_path) -> None:
    model, cp = own
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 4, 6)))
    tppc.export(staged, tmp_path)  # checked against torch and eager on the example
    runner = tppc.load(tmp_path, threads_per_stage=1)
    x = torch.randn(1, 6 * K, D)
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(x.numpy())), model(x))


def _export_equals_eager(model: nn.Module, cp: tppc.CompiledPipeline, bounds: tuple[int, ...],
                         path) -> None:
    """The artifact at 2 stages with chunks of whole blocks equals eager, and so does its
    greedy generate (a prompt of a block and a tail)."""
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=bounds))
    tppc.export(staged, path)
    runner = tppc.load(path, threads_per_stage=1)
    ids = torch.randint(0, 64, (1, 6 * K))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert_kernels_close(torch.from_numpy(runner(ids.numpy(), use_cache=False)["logits"]), want)
    prompt = ids[:, :K + 3]
    got = runner.generate(prompt.numpy(), max_new_tokens=6)
    assert (got == _eager_greedy(model, prompt, 6, use_cache=False).numpy()).all()


def test_mamba2_export_equals_eager_in_chunks_of_blocks(mamba2, tmp_path) -> None:
    _export_equals_eager(*mamba2, (0, 1, 2, 4, 6), tmp_path)


def test_falcon_h1_hybrid_is_exact_in_chunks_of_blocks(tmp_path) -> None:
    # Mamba2's mixer beside causal attention: the attention's chunks are whole blocks too
    transformers = pytest.importorskip("transformers")
    model = falcon_h1(transformers, K)
    cp = tppc.compile(model, (torch.randint(0, 64, (1, 4 * K)),), {"use_cache": False},
                      num_stages=2)
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 3, 6)))
    with torch.no_grad():
        for run, length in ((staged, 6 * K), (cp, 10 * K)):
            ids = torch.randint(0, 64, (2, length))
            assert_kernels_close(run(ids, use_cache=False).logits,
                                 model(ids, use_cache=False).logits)
    _export_equals_eager(model, cp, (0, 1, 3, 6), tmp_path)  # the artifact too
    # generate: the attention's K/V rewritten by position in each block step (filler rows
    # overwritten later, never read: causal), the mixer's states put back
    # (batch 2: captured again, the prompt grown by its last token; such an example once
    # passed the row-wise region check with the causal convolution inside, by tolerance)
    for batch, prompt in ((1, 3), (1, 2 * K + 2), (2, 3)):
        ids = torch.randint(0, 64, (batch, prompt))
        assert torch.equal(cp.generate(ids, max_new_tokens=9),
                           _eager_greedy(model, ids, 9, use_cache=False))
