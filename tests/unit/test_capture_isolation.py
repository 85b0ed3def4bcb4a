"""A capture leaves nothing in the user's model: same objects, same values, same flags."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tppc
from tests.oracles import assert_kernels_close
from tppc.errors import CaptureError
from tppc.frontend.isolation import ModuleSnapshot


def _state(model: nn.Module) -> dict[str, tuple[object, object]]:
    """Every attribute of every submodule: (the object, a copy of its value)."""
    out: dict[str, tuple[object, object]] = {}
    for path, module in model.named_modules():
        out[f"{path}:keys"] = (None, tuple(vars(module)))
        out[f"{path}:training"] = (None, module.training)
        tensors = {**vars(module), **module._parameters, **module._buffers}
        for name, value in tensors.items():
            if isinstance(value, torch.Tensor):
                out[f"{path}.{name}"] = (value, value.detach().clone())
        for name, child in module._modules.items():
            out[f"{path}/{name}"] = (child, None)
    return out


def _assert_same_state(before: dict, after: dict) -> None:
    assert list(after) == list(before)
    for key, (obj, value) in before.items():
        assert after[key][0] is obj, f"{key} is another object after the capture"
        if isinstance(value, torch.Tensor):
            assert type(after[key][1]) is torch.Tensor, f"{key} is a {type(after[key][1])}"
            torch.testing.assert_close(after[key][1], value, rtol=0, atol=0, msg=key)
        else:
            assert after[key][1] == value, f"{key}: {after[key][1]} != {value}"


class _LazyRope(nn.Module):
    """Rotary tables as early HF code wrote them: computed and stored on the first forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.inv_freq = None  # a plain attribute, set lazily
        self.calls = 0

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq is None:
            self.inv_freq = 1.0 / 10000 ** (torch.arange(0, self.dim, 2).float() / self.dim)
        if "scale" not in self._buffers:
            self.register_buffer("scale", torch.ones(()), persistent=False)
        self.calls += 1
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, -1))


class _LazyLM(nn.Module):
    """A two-block causal LM whose rotary embedding is initialised lazily."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rope = _LazyRope(hidden // heads)
        self.layers = nn.ModuleList(_Block(hidden, heads) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rope(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _lazy_lm() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _LazyLM().eval(), torch.randint(0, 64, (1, 12))


def test_a_snapshot_restores_objects_values_flags_and_containers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    model[0].cache = {"a": torch.ones(2)}
    before = _state(model)
    weight, running_mean, cache = model[0].weight, model[1].running_mean, model[0].cache
    snapshot = ModuleSnapshot.take(model)
    model.train()
    with torch.no_grad():
        model[1].running_mean.add_(1.0)
    model[1].running_var = torch.zeros(4)
    model[0].weight = nn.Parameter(torch.zeros(4, 4))
    model[0].register_buffer("extra", torch.ones(1))
    model[0].note = torch.ones(3)
    model[0].cache["b"] = torch.zeros(1)
    model.append(nn.ReLU())
    snapshot.restore()
    _assert_same_state(before, _state(model))
    assert model[0].weight is weight and model[1].running_mean is running_mean
    assert model[0].cache is cache and list(cache) == ["a"] and len(model) == 2


def test_a_parameter_written_in_place_is_named_since_no_weight_copy_is_kept() -> None:
    model = nn.Linear(2, 2)
    snapshot = ModuleSnapshot.take(model)
    with torch.no_grad():
        model.weight.mul_(2.0)
    with pytest.raises(CaptureError, match=r"\['weight'\].*fix:"):
        snapshot.restore()


def test_compiling_before_the_first_forward_leaves_a_lazy_model_untouched() -> None:
    model, ids = _lazy_lm()
    pristine = copy.deepcopy(model)
    before = _state(model)
    cp = tppc.compile(model, (ids,), chunks=2)
    _assert_same_state(before, _state(model))
    assert model.rope.inv_freq is None and "scale" not in model.rope._buffers
    assert model.rope.calls == 0
    longer = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        expected = pristine(longer)
        eager = model(longer)
    assert type(eager) is torch.Tensor
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)
    assert_kernels_close(cp(longer), expected)
    again = tppc.compile(model, (ids,), chunks=3)  # after an eager forward: state is real now
    assert_kernels_close(again(longer), expected)


class _FailsAfterLazyInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.table = torch.ones(8)  # lazy state, then a construct export refuses
        x = self.embed(input_ids) * self.table
        if x.sum() > 0:
            return x
        return -x


def test_a_failed_capture_leaves_the_model_untouched() -> None:
    model = _FailsAfterLazyInit().eval()
    before = _state(model)
    with pytest.raises(CaptureError):
        tppc.capture(model, (torch.randint(0, 16, (1, 8)),))
    _assert_same_state(before, _state(model))
    assert "table" not in vars(model)


def _phi3_longrope() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    head_dim, original = 16, 16
    cfg = transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * original,
        original_max_position_embeddings=original, pad_token_id=0, eos_token_id=1,
        bos_token_id=1, rope_scaling={"rope_type": "longrope",
                                      "short_factor": [1.0] * (head_dim // 2),
                                      "long_factor": [math.e] * (head_dim // 2)})
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(cfg).eval()


def test_phi3_longrope_compiled_before_its_first_forward_is_left_untouched() -> None:
    model = _phi3_longrope()
    pristine = copy.deepcopy(model)
    before = _state(model)
    ids = torch.randint(0, 128, (1, 8))
    cp = tppc.compile(model, (ids,))
    _assert_same_state(before, _state(model))
    assert "long_inv_freq" not in vars(model.model.rotary_emb)
    long_ids = torch.randint(0, 128, (1, 24))  # past original_max_position_embeddings: long_inv_freq
    with torch.no_grad():
        for x in (ids, long_ids):
            expected = pristine(x).logits
            eager = model(x).logits
            assert type(eager) is torch.Tensor
            torch.testing.assert_close(eager, expected, rtol=0, atol=0)
            assert_kernels_close(cp(x).logits, expected)
    again = tppc.compile(model, (ids,))
    with torch.no_grad():
        assert_kernels_close(again(ids).logits, pristine(ids).logits)
