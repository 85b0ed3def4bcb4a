"""Issue 31: rotary tables that depend on the call's length, exact at every length.

transformers' dynamic-NTK rope (``rope_type="dynamic"``: the frequencies of
``max(position_ids) + 1`` once it passes ``max_position_embeddings``) and Phi-3's longrope
(short or long factors on the same test) are captured as values of the call: every chunk
reads the table of the whole call, whatever the plan and the length; ``generate`` evaluates
it at each step's length (each token's cached K keep the table they were computed with, as
transformers' cache keeps them), and runs the whole sequence again where transformers'
Phi-3 drops its cache (``original_max_position_embeddings + 1`` tokens). A model of our own
whose rope base is scaled by ``x.shape[1]`` is exact too. Tiny configs, random weights,
``max_position_embeddings=16`` and calls of 10 to 48 tokens.

transformers' dynamic rope keeps state between calls (a call shorter than a longer one seen
before, but above the maximum, keeps the longer one's frequencies); the references here
reset it (:func:`_fresh`), which is what one forward or one ``generate`` computes from a
fresh model, and what tppc computes for every call.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close

transformers = pytest.importorskip("transformers")

VOCAB, ORIGINAL = 64, 16
STOP = {"eos_token_id": None, "pad_token_id": 0}
SENSITIVE = {"rope_theta": 100.0, "initializer_range": 0.3, "bos_token_id": 1, **STOP}
"""A small base and large weights: a wrong table changes the greedy tokens within a few."""


def _fresh(model: nn.Module) -> nn.Module:
    """Reset transformers' dynamic ropes to their state before any call."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len
    return model


def _dynamic(family: str = "llama", rope: dict | None = None) -> nn.Module:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=ORIGINAL, **SENSITIVE,
                          rope_scaling=rope or {"rope_type": "dynamic", "factor": 8.0})
    return model_class(config).eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _padded(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by 4."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, :4] = 0
    return _ids(2, length).masked_fill(mask == 0, 0), mask


def _counted(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs ``generate`` passes for a padded batch: the mask and the positions counted
    from it (one capture for the compile and the generation)."""
    return {"attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)}


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, tppc.CompiledPipeline]:
    model = _dynamic()
    cp = tppc.compile(model, (_ids(1, 24),), cluster="2xcpu", num_stages=2, chunks=3)
    return model, cp


def test_dynamic_ntk_calls_use_the_whole_calls_frequencies_at_every_length(llama) -> None:
    model, cp = llama
    assert len(cp.plan.stages) == 2 and len(cp.plan.chunks) == 3
    default = _dynamic(rope={"rope_type": "default"})
    default.load_state_dict(model.state_dict())
    for length in (24, 10, 16, 40, 48):  # the example, below and past the maximum: re-planned
        ids = _ids(1, length, seed=length)
        with torch.no_grad():
            want = _fresh(model)(ids).logits
            assert_kernels_close(cp(ids).logits, want)
            if length > ORIGINAL:  # the table matters: the default rope is far off there
                assert (default(ids).logits - want).abs().max() > 1e-2
    assert cp.program(24).signature.length_tables  # named as tables of the whole length


def test_dynamic_ntk_generate_equals_transformers_generate_past_the_maximum(llama) -> None:
    model, cp = llama
    for prompt in (10, 24):  # below the maximum, then growing past it; and past it already
        ids = _ids(1, prompt)
        with torch.no_grad():
            want = _fresh(model).generate(ids, max_new_tokens=14, do_sample=False, **STOP)
        assert torch.equal(cp.generate(ids, max_new_tokens=14, **STOP), want)


def test_dynamic_ntk_padded_generate_equals_transformers_generate() -> None:
    """Positions counted from ``attention_mask`` (passed by generate as ``position_ids``):
    the frequencies of ``max(position_ids) + 1`` are computed from that input whole."""
    model = _dynamic("qwen2")
    ids, mask = _padded(12)
    cp = tppc.compile(model, (ids,), _counted(mask), cluster="2xcpu", num_stages=2,
                      chunks=3)
    with torch.no_grad():
        want = _fresh(model).generate(ids, attention_mask=mask, max_new_tokens=10,
                                      do_sample=False, **STOP)
    assert torch.equal(cp.generate(ids, attention_mask=mask, max_new_tokens=10, **STOP), want)


def test_dynamic_ntk_exported_artifact_is_exact_and_generates_the_same_tokens(llama) -> None:
    model, cp = llama
    with tempfile.TemporaryDirectory() as out:
        tppc.export(cp, out, lengths=[10, 24, 40])
        runner = tppc.load(out)
        for length in (24, 40):
            ids = _ids(1, length, seed=length)
            with torch.no_grad():
                want = _fresh(model)(ids).logits
            assert_kernels_close(torch.as_tensor(runner(ids.numpy())["logits"]), want)
        ids = _ids(1, 10)
        with torch.no_grad():
            want = _fresh(model).generate(ids, max_new_tokens=14, do_sample=False, **STOP)
        assert torch.equal(torch.as_tensor(runner.generate(ids.numpy(), max_new_tokens=14)),
                           want)


def test_gemma3_dynamic_rope_of_one_layer_type_is_exact_at_every_length() -> None:
    """Per-layer-type ropes (``rope_type`` a dict, ``forward(x, positions, layer_type)``):
    dynamic NTK on the full-attention layers, the default rope on the sliding ones."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        max_position_embeddings=ORIGINAL, initializer_range=0.3,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 8.0,
                                            "rope_theta": 100.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    config._attn_implementation = "sdpa"
    model = transformers.Gemma3ForCausalLM(config).eval()
    cp = tppc.compile(model, (_ids(1, 24),), cluster="2xcpu", num_stages=2, chunks=3)
    rope = model.model.rotary_emb
    for length in (24, 10, 40):
        rope.full_attention_inv_freq = rope.full_attention_original_inv_freq.clone()
        vars(rope).pop("full_attention_max_seq_len_cached", None)  # a fresh module's state
        ids = _ids(1, length, seed=length)
        with torch.no_grad():
            assert_kernels_close(cp(ids).logits, model(ids).logits)


# -- Phi-3 longrope ------------------------------------------------------------------------------


def _phi3() -> nn.Module:
    torch.manual_seed(0)
    half = 8  # head_dim 16 / 2
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL, **SENSITIVE,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.1 * i for i in range(half)],
                      "long_factor": [3.0 + 2.0 * i for i in range(half)]})
    return transformers.Phi3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def phi3() -> tuple[nn.Module, tppc.CompiledPipeline]:
    model = _phi3()
    ids, mask = _padded(10)
    return model, tppc.compile(model, (ids,), _counted(mask), cluster="2xcpu", num_stages=2,
                               chunks=3)


def test_phi3_longrope_padded_generate_equals_transformers_generate(phi3) -> None:
    """A left-padded batch of 2 prompts shorter than ``original_max_position_embeddings``,
    generating past it: short factors first, then transformers' recomputation of the whole
    sequence with the long ones at 17 tokens (without it the 8th token differs)."""
    model, cp = phi3
    ids, mask = _padded(10)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              **STOP)
    assert torch.equal(cp.generate(ids, attention_mask=mask, max_new_tokens=12, **STOP), want)


def test_phi3_longrope_long_padded_prompt_generates_the_same_tokens(phi3) -> None:
    model, cp = phi3
    ids, mask = _padded(20)  # past the original maximum already: long factors throughout
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              **STOP)
        assert_kernels_close(cp(ids, **_counted(mask)).logits,
                             model(ids, **_counted(mask)).logits)
    assert torch.equal(cp.generate(ids, attention_mask=mask, max_new_tokens=8, **STOP), want)


def test_phi3_longrope_padded_artifact_is_exact_short_and_long(phi3) -> None:
    """The factor choice of ``position_ids`` whole, in ONNX (the input whole in every chunk)."""
    model, cp = phi3
    with tempfile.TemporaryDirectory() as out:
        tppc.export(cp, out, lengths=[10, 20])
        runner = tppc.load(out)
        for length in (10, 20):
            ids, mask = _padded(length)
            inputs = _counted(mask)
            with torch.no_grad():
                want = model(ids, **inputs).logits
            got = runner(ids.numpy(), **{k: v.numpy() for k, v in inputs.items()})["logits"]
            assert_kernels_close(torch.as_tensor(got), want)


def test_phi3_longrope_artifact_generates_transformers_tokens_across_the_switch() -> None:
    model = _phi3()
    ids = _ids(1, 10)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    with tempfile.TemporaryDirectory() as out:
        tppc.export(cp, out, lengths=[10, 24])
        runner = tppc.load(out)
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=12, do_sample=False, **STOP)
            long = _ids(1, 24, seed=24)
            assert_kernels_close(torch.as_tensor(runner(long.numpy())["logits"]),
                                 model(long).logits)
        assert torch.equal(torch.as_tensor(runner.generate(ids.numpy(), max_new_tokens=12)),
                           want)


# -- a model of our own ---------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class LengthScaledRopeLM(nn.Module):
    """A causal LM whose rope base grows with the call's length, written plainly:
    ``theta * (t / trained) ** 2`` from ``ids.shape[1]``."""

    def __init__(self, d: int = 32, heads: int = 4, trained: int = ORIGINAL) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.trained = heads, trained
        self.emb, self.head = nn.Embedding(VOCAB, d), nn.Linear(d, VOCAB)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, ids.shape[1], None)

    def rows(self, ids: torch.Tensor, length: int, cache: list | None) -> torch.Tensor:
        """The logits of ``ids``, the last rows of a sequence of ``length`` tokens whose
        earlier rows' K/V are in ``cache`` (a list per layer, extended; None: no cache)."""
        b, t = ids.shape
        hd = self.qkv[0].out_features // 3 // self.heads
        base = 100.0 * (length / self.trained) ** 2
        inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.arange(length - t, length, dtype=torch.float32)[:, None] * inv
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        x = self.emb(ids)
        for layer, (qkv, out) in enumerate(zip(self.qkv, self.out, strict=True)):
            q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2)
                       for z in qkv(x).chunk(3, -1))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if cache is not None and len(cache) > layer:  # a decode step: every key visible
                k, v = (torch.cat([c, z], 2) for c, z in zip(cache[layer], (k, v), strict=True))
                cache[layer] = (k, v)
                a = F.scaled_dot_product_attention(q, k, v)
            else:
                if cache is not None:
                    cache.append((k, v))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(a.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def test_a_rope_base_scaled_by_the_call_length_is_exact_at_every_length() -> None:
    model = LengthScaledRopeLM().eval()
    cp = tppc.compile(model, (_ids(1, 24),), cluster="2xcpu", num_stages=2, chunks=3)
    assert set(cp.program(24).signature.length_tables) == {"cos", "sin"}
    for length in (24, 10, 40):
        ids = _ids(1, length, seed=length)
        with torch.no_grad():
            assert_kernels_close(cp(ids), model(ids))


# -- a torch.distributed job ---------------------------------------------------------------------


def dynamic_llama_example() -> tuple[nn.Module, tuple[torch.Tensor], dict]:
    """The factory of the job below (``MODULE:FACTORY`` for :func:`tppc.launch`)."""
    return _dynamic(), (_ids(1, 10),), {}


def test_dynamic_ntk_generate_on_a_job_of_two_ranks_equals_transformers_generate(
        tmp_path) -> None:
    from tppc.distributed.checkpoint import save_checkpoint

    model, (ids,), _ = dynamic_llama_example()
    path = tmp_path / "llama.safetensors"
    save_checkpoint(model, path)
    result = tppc.launch("tests.integration.test_length_ropes:dynamic_llama_example", 2,
                         checkpoint=path, inputs={"args.0": ids}, generate=14, timeout=300)
    with torch.no_grad():
        want = _fresh(model).generate(ids, max_new_tokens=14, do_sample=False, **STOP)
    assert torch.equal(result.outputs["ids"], want)


def test_a_length_scaled_rope_generates_as_a_model_with_a_kv_cache() -> None:
    """tppc's generate on a model of our own: each token's table is the one of the length
    when it is computed, the cached K/V keep theirs (an eager decode loop with a cache,
    which differs from recomputing the whole sequence at every step)."""
    model = LengthScaledRopeLM().eval()
    ids = _ids(1, 10)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    want, cache = ids, []
    with torch.no_grad():
        logits = model.rows(ids, 10, cache)
        for n in range(11, 23):
            want = torch.cat([want, logits[:, -1:].argmax(-1)], 1)
            logits = model.rows(want[:, -1:], n, cache)
        want = torch.cat([want, logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(cp.generate(ids, max_new_tokens=13, eos_token_id=None), want)
