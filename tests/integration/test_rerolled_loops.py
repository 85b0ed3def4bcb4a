"""Recurrences stepped in a Python loop over positions, re-rolled by the capture and carried.

transformers' ``MambaForCausalLM`` (its CPU path: ``for index in range(seq_len)``, outputs
``torch.stack``-ed), and a model of our own in a new form: a gated matrix-state cell (a GRU-like
update of a ``(batch, heads, d, d)`` state, outputs stacked along ``dim=1``). torch.export
unrolls both at the example's length; the capture re-rolls the loop into one node whose
carries are state buffers of its stage (docs/capture.md#re-rolled-loops). Checked against
eager at 2 stages with chunks of one token and more, at re-planned lengths, in ``generate``,
and priced linear in the chunk. FalconMamba and Jamba (Mamba mixers beside attention and
experts) are the same path (CI skips them: tests/ci_skips.txt). A loop whose final state is
read after it is refused naming its line. ``tppc.export`` writes the loop as an ONNX ``Loop``
over the chunk's rows, exact through ``tppc.load`` (generate included).
"""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.node_costs import C, P
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.planner.manual import manual_plan

D, H, E, VOCAB, LENGTH = 16, 2, 4, 64, 6
BOUNDS = (0, 1, 2, 4, LENGTH)  # chunks of one token and of two


class GatedMatrixCell(nn.Module):
    """A GRU-like matrix memory: ``S_t = (1 − z_t)·S_{t−1} + z_t·tanh(k_t v_tᵀ)``, ``y_t =
    q_t S_t``, per head, stepped in Python."""

    def __init__(self, final_state: bool = False) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(D), nn.Linear(D, 4 * H * E)
        self.out, self.final_state = nn.Linear(H * E, D), final_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v, z = self.proj(self.norm(x)).view(b, n, 4, H, E).unbind(2)
        z = torch.sigmoid(z)
        state = torch.zeros(b, H, E, E, dtype=x.dtype, device=x.device)
        outs = []
        for t in range(n):
            cand = torch.tanh(k[:, t, :, :, None] * v[:, t, :, None, :])
            state = (1 - z[:, t, :, :, None]) * state + z[:, t, :, :, None] * cand
            outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
        y = self.out(torch.stack(outs, dim=1).reshape(b, n, H * E))
        return x + y + (state.sum() if self.final_state else 0)


class MatrixLM(nn.Module):
    def __init__(self, final_state: bool = False) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(GatedMatrixCell(final_state) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class BlockDecay(nn.Module):
    """A decayed linear memory stepped over blocks of 2 rows in Python (a lightning-attention
    form of our own): per block, ``y = q·S + causal(q kᵀ)·v``, ``S ← d·S + kᵀv``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(D, 3 * E), nn.Linear(E, D)
        self.register_buffer("mask", torch.tril(torch.ones(2, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.proj(x).split(E, dim=-1)
        state = torch.zeros(b, E, E)
        outs = []
        for i in range(n // 2):
            qi, ki, vi = q[:, 2 * i:2 * i + 2], k[:, 2 * i:2 * i + 2], v[:, 2 * i:2 * i + 2]
            outs.append(qi @ state + ((qi @ ki.transpose(1, 2)) * self.mask) @ vi)
            state = 0.9 * state + ki.transpose(1, 2) @ vi
        return x + self.out(torch.cat(outs, dim=1))


class BlockLM(MatrixLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BlockDecay() for _ in range(2))


def _mamba(transformers, kind: str = "Mamba") -> nn.Module:
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=D, state_size=4, num_hidden_layers=2,
        intermediate_size=2 * D, conv_kernel=4, use_mambapy=False, use_cache=False)
    return getattr(transformers, f"{kind}ForCausalLM")(config).eval()


def _jamba(transformers) -> nn.Module:
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=2, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, use_cache=False,
        use_mamba_kernels=False)).eval()


def _minimax(transformers) -> nn.Module:
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"],
        block_size=4, use_cache=False)).eval()


def _compile(model: nn.Module, batch: int = 2) -> tppc.CompiledPipeline:
    return tppc.compile(model, (torch.randint(0, VOCAB, (batch, LENGTH)),), cluster="2xcpu")


def _logits(out: object) -> torch.Tensor:
    return getattr(out, "logits", out)


def _staged(cp: tppc.CompiledPipeline) -> tppc.CompiledPipeline:
    n = len(cp.context.layers)
    return cp.with_plan(manual_plan(n, LENGTH, cuts=(0, n // 2, n), boundaries=BOUNDS))


@pytest.fixture(scope="module")
def mamba() -> tuple[nn.Module, tppc.CompiledPipeline]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _mamba(transformers)
    return model, _compile(model)


@pytest.fixture(scope="module")
def matrix() -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = MatrixLM().eval()
    return model, _compile(model)


def test_mamba_loop_is_one_recurrent_node_per_layer(mamba) -> None:
    _, cp = mamba
    assert cp.context.rerolled.startswith("transformers/models/mamba/modeling_mamba.py:")
    loops = [n for n in cp._front.annotated.graph.nodes
             if type(n.target).__name__ == "LoopScan"]
    assert len(loops) == 2
    assert all(n.meta["tppc.token"].attention == "recurrent" for n in loops)


@pytest.mark.parametrize("which", ["mamba", "matrix"])
def test_two_stages_chunks_of_one_token_and_more_equal_eager(which, request) -> None:
    model, cp = request.getfixturevalue(which)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert_kernels_close(_logits(_staged(cp)(ids)), _logits(model(ids)))


@pytest.mark.parametrize("which", ["mamba", "matrix"])
def test_replanned_lengths_equal_eager(which, request) -> None:
    model, cp = request.getfixturevalue(which)
    for length in (3, 11):
        ids = torch.randint(0, VOCAB, (2, length))
        with torch.no_grad():
            assert_kernels_close(_logits(cp(ids)), _logits(model(ids)))


def test_own_matrix_state_is_carried_bit_exactly(matrix) -> None:
    model, cp = matrix
    states = sorted({b.shape for st in _staged(cp).program(LENGTH).stages for b in st.buffers
                     if b.kind == "state"})
    assert states == [(2, 2, H, E, E)]  # slot 0 (the initial zeros) and 1, per loop
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert torch.equal(_staged(cp)(ids), model(ids))  # the same ops in the same order


def test_mamba_generate_continues_from_the_prefill_states(mamba) -> None:
    model, cp = mamba
    prompt = torch.randint(0, VOCAB, (2, 5))
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                          do_sample=False, use_cache=False)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), want)


def test_own_loop_generate_equals_the_eager_greedy_tokens(matrix) -> None:
    model, cp = matrix
    prompt = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), greedy_reference(model, prompt, 4))


def test_loop_layers_cost_their_rows_only(mamba) -> None:
    _, cp = mamba
    front = cp._front
    exprs = layer_expressions(front.chunk, front.ctx.layers, DEVICE_PRESETS["h100-sxm"], 64,
                              seq_symbol=front.ctx.seq_symbol)
    mixers = exprs[1:-1]
    assert mixers
    for expr in mixers:
        assert P not in expr.time.free_symbols  # no prefix term
        assert sympy.degree(sympy.expand(expr.matrix_flops), C) == 1  # the step's matmul
        assert expr.kv_bytes_per_token == 0


def test_final_state_read_after_the_loop_is_refused_naming_its_line() -> None:
    model = MatrixLM(final_state=True).eval()
    with pytest.raises(tppc.CaptureError, match=r"(?s)Python loop.*test_rerolled_loops\.py:\d+ "
                       r"in forward \(`for t in range\(n\):`\).*read after the loop.*fix:"):
        tppc.capture(model, (torch.randint(0, VOCAB, (1, 4)),))


@pytest.mark.parametrize("make", [lambda t: _mamba(t, "FalconMamba"), _jamba],
                         ids=["falcon_mamba", "jamba"])
def test_hf_mamba_mixers_equal_eager_at_two_stages(make) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make(transformers)
    cp = _compile(model, batch=1)
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    with torch.no_grad():
        assert_kernels_close(_staged(cp)(ids).logits, model(ids).logits)
        longer = torch.randint(0, VOCAB, (1, 2 * LENGTH + 1))
        assert_kernels_close(cp(longer).logits, model(longer).logits)


@pytest.mark.parametrize("which", ["mamba", "matrix"])
def test_exported_loop_equals_eager_in_chunks_and_generate(which, request, tmp_path) -> None:
    """The loop as an ONNX Loop over the chunk's rows, its carries between the chunk sessions
    as any state buffer's: 2 stages, chunks of one token, generate (tppc.load)."""
    model, cp = request.getfixturevalue(which)
    tppc.export(_staged(cp), tmp_path)  # checked against torch and eager on the example
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        out = runner(ids.numpy())
        got = out["logits"] if which == "mamba" else out
        assert_kernels_close(torch.from_numpy(got), _logits(model(ids)))
    prompt = torch.randint(0, VOCAB, (2, LENGTH))  # the length it was exported for
    want = greedy_reference(lambda x: _logits(model(x)), prompt, 3)
    assert torch.equal(torch.from_numpy(runner.generate(prompt.numpy(), max_new_tokens=3)),
                       want)


def test_minimax_loop_over_blocks_equals_eager_in_chunks_of_blocks_and_generate(
        tmp_path) -> None:
    """MiniMax's lightning attention steps blocks of 4 rows (``for i in range(num_blocks)``,
    outputs concatenated): re-rolled over blocks, a unit of the plan is one block (as a block
    scan's), exact at 2 stages in chunks of one block, at other whole numbers of blocks and in
    generate (each decode step re-runs its block), torch and exported."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _minimax(transformers)
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 8)),), cluster="2xcpu")
    assert cp.context.block_size == 4 and "modeling_minimax.py" in cp.context.rerolled
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 3, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 3)))
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert_kernels_close(staged(ids).logits, model(ids).logits)
        longer = torch.randint(0, VOCAB, (1, 20))
        assert_kernels_close(cp(longer).logits, model(longer).logits)
    prompt = torch.randint(0, VOCAB, (1, 6))
    want = greedy_reference(lambda x: model(x).logits, prompt, 3)
    assert torch.equal(cp.generate(prompt, max_new_tokens=3), want)
    tppc.export(staged, tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    with torch.no_grad():
        got = runner(ids.numpy(), use_cache=False)["logits"]
        assert_kernels_close(torch.from_numpy(got), model(ids).logits)
    prompt = ids[:, :6]  # one block and a half
    want = greedy_reference(lambda x: model(x).logits, prompt, 3).numpy()
    assert (runner.generate(prompt.numpy(), max_new_tokens=3) == want).all()


def test_own_loop_over_blocks_is_exact_in_chunks_of_blocks_and_exported(tmp_path) -> None:
    torch.manual_seed(0)
    model = BlockLM().eval()
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 8)),), cluster="2xcpu")
    assert cp.context.block_size == 2  # a unit of the plan is a block of rows
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 4, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 4)))
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        assert torch.equal(staged(ids), model(ids))
        assert torch.equal(cp(ids[:, :6]), model(ids[:, :6]))
    tppc.export(staged, tmp_path)  # the loop over blocks as an ONNX Loop of Slices
    runner = tppc.load(tmp_path, threads_per_stage=1)
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(ids.numpy())), model(ids))


@pytest.mark.parametrize("make", [lambda t: _mamba(t, "FalconMamba"), _jamba],
                         ids=["falcon_mamba", "jamba"])
def test_hf_mamba_mixers_export_exactly(make, tmp_path) -> None:
    """FalconMamba's and Jamba's re-rolled loops (Jamba's beside attention and experts) as
    ONNX Loops at 2 stages, through tppc.load."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make(transformers)
    tppc.export(_staged(_compile(model, batch=1)), tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    with torch.no_grad():
        got = torch.from_numpy(runner(ids.numpy())["logits"])
        assert_kernels_close(got, model(ids).logits)


def test_recurrent_gemma_rg_lru_loop_is_exact_at_two_stages() -> None:
    """RecurrentGemma's RG-LRU steps positions in a Python loop (``_rnn_scan``); its gates'
    ``baddbmm`` is decomposed where its meta kernel wants concrete sizes (was refused)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "attention"], use_cache=False)).eval()
    cp = _compile(model, batch=1)
    with torch.no_grad():
        for length in (LENGTH, 2 * LENGTH + 1):
            ids = torch.randint(0, VOCAB, (1, length))
            assert_kernels_close(_staged(cp)(ids).logits if length == LENGTH
                                 else cp(ids).logits, model(ids).logits)


def test_recurrent_gemma_generate_on_a_left_padded_batch_equals_transformers() -> None:
    """With ``attention_mask`` and ``position_ids`` (a left-padded batch) its reset gate
    ``reset + ~reset * multiplier`` (modeling_recurrent_gemma.py:329) pinned the length before
    the loop did: the re-rolled capture takes the three sequence inputs (was refused)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "attention"], use_cache=False, pad_token_id=0)).eval()
    cp = _compile(model)
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(cp.generate(ids, attention_mask=mask, max_new_tokens=5), want)
