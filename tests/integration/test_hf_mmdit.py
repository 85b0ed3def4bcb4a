"""diffusers MM-DiTs whose text tokens are not a prefix (issue 21): SD3 joins them after the
image tokens (a suffix segment); against eager and the serial denoising loop."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc import examples

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def sd3():
    model, args, kwargs = examples.hf_sd3()
    return model, args, kwargs, tppc.compile(model, args, kwargs, num_stages=2,
                                             executor="threads")


def test_sd3_joins_the_text_after_the_image(sd3) -> None:
    model, args, kwargs, cp = sd3
    ctx = cp.context
    assert ctx.capture_mode == "dynamic" and ctx.seq_inputs == {"hidden_states": (2,)}
    buffers = [b for stage in cp.program(cp.plan.seq_len).stages for b in stage.buffers]
    assert len(buffers) == 2 * model.config.num_layers  # K and V of each joint attention
    assert {(b.prefix, b.scale, b.suffix) for b in buffers} == {(0, 4, 6)}  # 4 patches a row
    with torch.no_grad():
        assert_kernels_close(cp(*args, **kwargs)[0], model(*args, **kwargs)[0])


def test_sd3_denoises_like_the_serial_loop(sd3) -> None:
    model, (x,), kwargs, cp = sd3
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    ref = serial_denoise(model, x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, model_kwargs=kw)
    for patches in (2, 4):
        out = cp.denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, warmup_steps=3,
                         patches=patches, model_kwargs=kw)
        assert_kernels_close(out, ref, depth=3)
    # stale patches: the first patch of a step writes the text K/V after the image rows; the
    # patch program is checked against the one-chunk program on the first call
    stale = cp.denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, warmup_steps=1,
                       patches=2, model_kwargs=kw)
    assert torch.isfinite(stale).all() and not torch.equal(stale, ref)
    assert float(((stale - ref) ** 2).mean()) < 0.1 * float((ref**2).mean())


def test_qwen_image_is_refused_naming_its_integer_size_input() -> None:
    """QwenImage joins text before the image (a prefix), but its rotary table is built from
    ``img_shapes``, Python ints that torch.export keeps constant: the length is pinned."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(2, 2, 4)).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, 6, 12),
              "encoder_hidden_states_mask": torch.ones(1, 6), "timestep": torch.tensor([0.5]),
              "img_shapes": [(1, 4, 4)], "return_dict": False}
    with pytest.raises(tppc.CaptureError, match=r"integer input img_shapes=\[\(1, 4, 4\)\]"):
        tppc.annotate(model, (torch.randn(1, 16, 16),), kwargs)
