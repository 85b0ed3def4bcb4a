"""Video latents with the text after the image tokens (HunyuanVideo's joint attention).

An own toy video DiT: two frames patchified frame-major, ``cat([image, text])`` into
bidirectional joint attention under a mask that hides the padded text keys (built from the
prompt mask's sum, as HunyuanVideo does). A chunk is a band of patch rows in every frame, and
the first chunk of a step also carries the text: its K/V write must put the text after the
buffer's last frame, not count it as frame rows (before: 0.8 off, refused by translation
validation). The mask reads the values of an input that is not a sequence input: annotation
once probed it with the example's prompt mask (all ones), found it all-visible and dropped it,
so a padded prompt ran silently wrong; it is now evaluated whole per call (a key mask).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc.errors import AnnotationError

diffusers = pytest.importorskip("diffusers")


class _VideoTextAfter(nn.Module):
    """Patchified frames ``(b, c, f, H, W)``, joint attention ``[frames | text]``, unpatchify."""

    patch_size = 2

    def __init__(self, c: int = 4, d: int = 16, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv3d(c, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.txt_in, self.time = nn.Linear(6, d), nn.Linear(1, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(depth))
        self.txt_mlp = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.out = nn.Linear(d, c * 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor) -> torch.Tensor:
        b, c, f, height, width = x.shape
        d, n = self.out.in_features, text.shape[1]
        h = self.embed(x).flatten(2).transpose(1, 2)  # frame-major (f, rows, cols) patches
        h = h + self.time(t.float()[:, None])[:, None]
        e = self.txt_in(text)
        tokens = f * (height // 2) * (width // 2)
        seen = tokens + text_mask.sum(dim=1, keepdim=True)  # the first text tokens are seen
        mask = self.mask(torch.arange(tokens + n)[None] < seen)
        for qkv, mlp in zip(self.qkv, self.txt_mlp, strict=True):
            joint = torch.cat([h, e], dim=1)  # [frames | text]
            q, k, v = qkv(joint).view(b, -1, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            a = a.transpose(1, 2).reshape(b, -1, d)
            h, e = h + a[:, :-n], e + mlp(a[:, -n:])
        out = self.out(h).view(b, f, height // 2, width // 2, c, 2, 2)
        return out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, height, width)

    def mask(self, valid: torch.Tensor) -> torch.Tensor:
        """One row over the keys, broadcast along the queries."""
        return valid[:, None, None, :]


class _QueryAndKeyMask(_VideoTextAfter):
    """The same mask on queries and keys: it varies along the query axis."""

    def mask(self, valid: torch.Tensor) -> torch.Tensor:
        return valid[:, None, :, None] & valid[:, None, None, :]


_PADDED = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])


@pytest.fixture(scope="module")
def video():
    """The model, its example (2 frames of 4x4 patches, 5 text tokens) and its pipeline."""
    torch.manual_seed(0)
    model = _VideoTextAfter().eval()
    args = (torch.randn(1, 4, 2, 8, 8), torch.tensor([10]), torch.randn(1, 5, 6),
            torch.ones(1, 5))
    return model, args, tppc.compile(model, args, num_stages=2, executor="local")


def test_text_after_video_frames_is_exact(video) -> None:
    model, args, cp = video
    assert cp.context.patch_grid == (2, 4, 4)
    buffers = [b for stage in cp.program(4).stages for b in stage.buffers]
    assert {(b.prefix, b.scale, b.suffix) for b in buffers} == {(0, 8, 5)}
    with torch.no_grad():
        assert_kernels_close(cp(*args), model(*args))


def test_a_padded_prompt_hides_its_text_keys_as_in_eager(video) -> None:
    """Compiled with a prompt mask of ones, called with a padded one (a key mask)."""
    model, (x, t, text, _), cp = video
    with torch.no_grad():
        want, unmasked = model(x, t, text, _PADDED), model(x, t, text, torch.ones(1, 5))
        assert (want - unmasked).abs().max() > 1e-3  # the padding changes the result
        assert_kernels_close(cp(x, t, text, _PADDED), want)
    kinds = {spec.kind for stage in cp.program(4).stages for _, spec in stage.inputs}
    assert "full" not in kinds  # the mask reads the latent's size only, never its rows


def test_a_prompt_mask_over_queries_and_keys_is_refused_by_name() -> None:
    args = (torch.randn(1, 4, 2, 8, 8), torch.tensor([10]), torch.randn(1, 5, 6),
            torch.ones(1, 5))
    with pytest.raises(AnnotationError, match=r"reads the values of input\(s\) \['text_mask'\]"
                       r".*varies along the query axis"):
        tppc.annotate(_QueryAndKeyMask().eval(), args)


def test_text_after_video_frames_denoises_exactly_with_every_step_warm(video) -> None:
    model, (x, _, text, _), cp = video
    kw = {"text": text, "text_mask": _PADDED}
    ref = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t",
                         model_kwargs=kw)
    out = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=2, patches=2,
                     model_kwargs=kw, timestep_arg="t")
    assert_kernels_close(out, ref, depth=2)
    # stale bands: the first such call checks the patch program against one chunk after a
    # full warm-up (SoundnessError if they differ)
    stale = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=2,
                       model_kwargs=kw, timestep_arg="t")
    assert stale.isfinite().all() and not torch.allclose(stale, ref)


class _GatheredText(nn.Module):
    """The valid text tokens gathered by ``torch.nonzero`` of the prompt mask (as Mochi
    does), then joined after the image tokens: a segment of data-dependent length."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(4, d), nn.Linear(6, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x: torch.Tensor, text: torch.Tensor, text_mask: torch.Tensor
                ) -> torch.Tensor:
        h = self.img(x)
        e = self.txt(text)[:, torch.nonzero(text_mask[0]).flatten()]
        for block in self.blocks:
            joint = block(torch.cat([h, e], dim=1))[:, None]
            h = h + F.scaled_dot_product_attention(joint, joint, joint)[:, 0, : x.shape[1]]
        return h


def test_text_gathered_to_a_data_dependent_length_is_refused_by_name() -> None:
    args = (torch.randn(1, 12, 4), torch.randn(1, 5, 6), torch.ones(1, 5))
    with pytest.raises(AnnotationError, match=r"data-dependent length u\d+ along the token "
                       r"axis.*fix: keep every text token"):
        tppc.annotate(_GatheredText().eval(), args)
