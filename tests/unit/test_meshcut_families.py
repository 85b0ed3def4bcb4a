"""Worker graphs of diffusers DiTs from tiny configs on stage meshes: a guided batch of 2
cut by CFG parallelism, sequence parallelism (joint text + image attention included: the
text whole on every worker, its heads under Ulysses), tensor parallelism, and the refusals
by name where the form does not apply (linear attention). Ring attention passes each worker's
own K/V block around (joint attention: the text whole on every worker, attended in its first
step); videos keep the ring's gather form (``tppc.passes.meshcut.ring_form``), each worker
taking its band of rows in every frame. Compared with
the eager model (nothing is downloaded).
"""

from __future__ import annotations

import pytest
import torch

from tests.oracles import assert_kernels_close
from tests.unit.meshcut_oracle import run_mesh, staged
from tppc import examples
from tppc.errors import SpecError
from tppc.program.mesh import Mesh

diffusers = pytest.importorskip("diffusers")


def _guided(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Every input with a batch of 1 made a batch of 2 whose halves differ."""
    def two(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == 1:
            return torch.cat([t, t * 0.5 + 0.25 if t.is_floating_point() else t])
        return t
    return tuple(two(a) for a in args), {k: two(v) for k, v in kwargs.items()}


def _pixart4():
    """PixArt with 4 heads (TP 2 x Ulysses 2 divides them)."""
    torch.manual_seed(0)
    model = diffusers.PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=4, in_channels=4, out_channels=8,
        num_layers=1, sample_size=8, patch_size=2, cross_attention_dim=16,
        caption_channels=12, norm_type="ada_norm_single", use_additional_conditions=False,
    ).eval()
    return model, (torch.randn(1, 4, 8, 8),), {
        "encoder_hidden_states": torch.randn(1, 6, 12), "timestep": torch.tensor([10]),
        "return_dict": False}


def _sana():
    torch.manual_seed(0)
    model = diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
        cross_attention_dim=16, caption_channels=16, mlp_ratio=2.0, sample_size=8,
        patch_size=1).eval()
    return model, (torch.randn(1, 4, 8, 8),), {
        "encoder_hidden_states": torch.randn(1, 6, 16), "timestep": torch.tensor([10]),
        "return_dict": False}


def _wan():
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=16, ffn_dim=16, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "timestep": torch.tensor([10]), "encoder_hidden_states": torch.randn(1, 6, 12),
        "return_dict": False}


FAMILIES = {
    # family: (factory, exact meshes, refused mesh and message)
    "pixart": (_pixart4, [Mesh(cfg=2, ring=2), Mesh(ring=2, ulysses=2), Mesh(ulysses=2, tp=2)],
               None),
    "hunyuan_dit": (lambda: examples.hf_hunyuan_dit(layers=2), [Mesh(cfg=2, ulysses=2)],
                    None),
    "sd3": (lambda: examples.hf_sd3(layers=1),  # text after the image, written apart
            [Mesh(cfg=2, tp=2), Mesh(ulysses=2), Mesh(ring=2)], None),
    "flux": (lambda: examples.hf_flux(single_layers=1),  # text before the image
             [Mesh(cfg=2), Mesh(ring=2, ulysses=2), Mesh(ring=2, tp=2)],
             (Mesh(ulysses=2, tp=2), r"has 1 query heads per worker; ulysses=2 .* fix")),
    "cogvideox": (lambda: examples.hf_cogvideox(layers=1),  # text, then 2 frames
                  [Mesh(cfg=2), Mesh(ring=2, ulysses=2)],
                  (Mesh(ulysses=2, tp=2), r"has 1 query heads per worker; ulysses=2 .* fix")),
    "sana": (_sana, [Mesh(cfg=2), Mesh(tp=2)],
             (Mesh(ring=2), r"matmul_key_buffer .* another kind of token mixing .* fix")),
    "wan": (_wan, [Mesh(cfg=2, ulysses=2), Mesh(ring=2)], None),  # 2 frames
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_on_its_meshes_or_refused_by_name(family: str) -> None:
    factory, meshes, refused = FAMILIES[family]
    model, args, kwargs = factory()
    st = staged(model, *_guided(args, kwargs))
    for mesh in meshes:
        got = run_mesh(st, mesh)[0]
        assert_kernels_close(got, st.want[0])
    if refused is not None:
        mesh, message = refused
        with pytest.raises(SpecError, match=message):
            run_mesh(st, mesh)
