"""One compile serves several resolutions (issue 21): a call at a latent size the capture does
not serve (a ``specialized`` capture's other resolutions, another width, a size that fails
the capture's shape guards) is captured again and cached, never refused; the oracle is the
eager model at that size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc import examples
from tppc.examples.models.dit import DiT, DiTConfig

diffusers = pytest.importorskip("diffusers")


def test_pixart_compiled_at_its_sample_size_runs_other_resolutions_exactly() -> None:
    model, args, kwargs = examples.hf_pixart(size=8, layers=1)
    kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
    cp = tppc.compile(model, args, kwargs)
    assert cp.context.capture_mode == "specialized"
    fronts = {}
    for shape in [(8, 12), (12, 8), (8, 8), (8, 12)]:  # 16x16: docs/diffusion.md
        x = torch.randn(1, 4, *shape)
        with torch.no_grad():
            assert_kernels_close(cp(x, **kwargs).sample, model(x, **kwargs).sample)
        fronts.setdefault(shape, []).append(cp.bind((x,), kwargs)[0])
    assert fronts[(8, 12)][0] is fronts[(8, 12)][1]  # a size served before: no new capture
    x = torch.randn(1, 4, 13, 8)  # 6.5 patch rows: PixArt itself drops the half row; so does tppc
    with torch.no_grad():
        assert_kernels_close(cp(x, **kwargs).sample, model(x, **kwargs).sample)
    assert cp.bind((x,), kwargs)[0] is fronts[(12, 8)][0]
    wrong = {**kwargs, "encoder_hidden_states": torch.randn(1, 6, 10)}  # hidden size 12
    with pytest.raises(tppc.RuntimeInputError, match=r"^input 'encoder_hidden_states' axis 2 "
                       r"is 10, compiled with 12: PixArtTransformer2DModel itself fails at these "
                       r"sizes \(RuntimeError: .*\), so no capture was tried"):
        cp(x, **wrong)
    # 12x8 is captured dynamic (it computes its table); its guards refuse 8x8 (PixArt's
    # sample size reads the stored table instead): 8x8 stays on the compile's own capture
    assert fronts[(12, 8)][0].ctx.capture_mode == "dynamic"
    assert fronts[(8, 8)][0] is cp.bind(args, kwargs)[0] is not fronts[(12, 8)][0]
    rest = {"encoder_hidden_states": kwargs["encoder_hidden_states"]}
    x = torch.randn(1, 4, 8, 12)
    half = lambda o: o[:, :4]  # noqa: E731  (drop the learned sigma)
    got = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=2, patches=2,
                     model_kwargs=rest, output_transform=half)
    want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, model_kwargs=rest,
                          output_transform=half)  # the model output's sample, halved
    assert_kernels_close(got, want, depth=2)


class InterpolatedTableDiT(torch.nn.Module):
    """A toy DiT whose learned 4x4 positional table is bilinearly interpolated to the latent's
    patch grid at run time (a ViT-style ``interpolate_pos_encoding``)."""

    def __init__(self, dim: int = 16, patch: int = 2) -> None:
        super().__init__()
        self.patch_size = patch
        self.proj = torch.nn.Conv2d(4, dim, patch, stride=patch)
        self.table = torch.nn.Parameter(torch.randn(1, dim, 4, 4))
        self.temb = torch.nn.Linear(1, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.out = torch.nn.Linear(dim, 4 * patch * patch)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        p, rows, cols = self.patch_size, h // self.patch_size, w // self.patch_size
        pos = F.interpolate(self.table, size=(rows, cols), mode="bilinear", align_corners=False)
        tokens = self.proj(x).flatten(2).transpose(1, 2) + pos.flatten(2).transpose(1, 2)
        tokens = tokens + self.temb(t.float()[:, None] / 1000)[:, None]
        for block in self.blocks:
            tokens = block(tokens)
        out = self.out(tokens).reshape(b, rows, cols, 4, p, p)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, 4, h, w)


def test_a_positional_table_interpolated_to_the_grid_is_dynamic_and_exact() -> None:
    torch.manual_seed(0)
    model = InterpolatedTableDiT().eval()
    t = torch.tensor([10])
    cp = tppc.compile(model, (torch.randn(1, 4, 8, 8), t))
    assert cp.context.capture_mode == "dynamic"  # every height, one capture per width
    for shape in [(12, 8), (8, 12)]:
        x = torch.randn(1, 4, *shape)
        with torch.no_grad():
            assert_kernels_close(cp(x, t), model(x, t))
        got = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=2, patches=2,
                         timestep_arg="t")
        want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t")
        assert_kernels_close(got, want, depth=2)


def test_cogvideox_at_a_size_other_than_its_config_is_exact() -> None:
    """Its patch embedding rebuilds the sincos table through ``.data`` at a size other than
    its config's (a fake constant in the capture: refused before); the traced copy gets the
    table of the latent's size, the user's model keeps its own."""
    model, _, _ = examples.hf_cogvideox(size=8, frames=2, layers=1)
    table = model.patch_embed.pos_embedding
    x = torch.randn(1, 2, 4, 12, 8)
    _, _, kwargs = examples.hf_cogvideox(size=8, frames=2, layers=1)
    cp = tppc.compile(model, (x,), kwargs, num_stages=2, verify=False)  # eager is the oracle
    with torch.no_grad():
        assert_kernels_close(cp(x, **kwargs)[0], model(x, **kwargs)[0])
    assert model.patch_embed.pos_embedding is table and model.patch_embed.sample_height == 8


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freq = torch.exp(-9.2103 * torch.arange(half) / half)
    ang = pos.float()[:, None] * freq[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class _RowPositionsDiT(DiT):
    """The project's DiT whose row positions are an input: a 1-D float tensor as long as the
    latent's patch rows (interpolated positions a caller may shift), not an ``arange``.
    ``flip_rows``: the rows read in reverse (an op along the rows: no chunk can run alone)."""

    flip_rows = False

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                row_pos: torch.Tensor) -> torch.Tensor:
        b, ch, height, width = x.shape
        p = self.patch_size
        hp, wp = height // p, width // p
        tok = self.patch(x).flatten(2).transpose(1, 2)
        rows = (row_pos.flip(0) if self.flip_rows else row_pos).repeat_interleave(wp)
        cols = torch.arange(wp, device=x.device).repeat(hp)
        half = tok.shape[-1] // 2
        tok = tok + torch.cat([_sincos(rows, half), _sincos(cols, half)], dim=-1)[None]
        c = self.t_mlp(_sincos(t, tok.shape[-1])) + self.y_emb(y)
        for block in self.blocks:
            tok = block(tok, c)
        shift, scale = self.ada_f(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        tok = self.out(self.norm_f(tok) * (1 + scale) + shift)
        tok = tok.view(b, hp, wp, p, p, ch).permute(0, 5, 1, 3, 2, 4)
        return tok.reshape(b, ch, height, width)


def test_a_length_pinned_by_a_1d_positional_input_runs_at_every_resolution() -> None:
    """``row_pos`` (as long as the patch rows) pins the length: torch.export guards
    ``4 * (h // 2) == 16``. Captured again with ``row_pos`` as a sequence input, its
    ``repeat_interleave`` into one entry per token is a row-wise reshape (was refused as an op
    resizing the token axis): one capture runs every resolution exactly, and denoises with
    patches (the first call's patch check passes) equal to the serial loop every step warm."""
    torch.manual_seed(0)
    model = _RowPositionsDiT(DiTConfig(hidden=32, depth=2, n_head=2)).eval()
    t, y = torch.tensor([3]), torch.tensor([1])
    cp = tppc.compile(model, (torch.randn(1, 4, 8, 8), t, y, torch.arange(4) * 0.5 + 0.25),
                      num_stages=2)
    assert cp.context.capture_mode == "dynamic"
    assert cp.context.seq_inputs == {"x": (2,), "row_pos": (0,)}
    for height in (12, 6, 8):
        args = (torch.randn(1, 4, height, 8), t, y, torch.arange(height // 2) * 0.37 + 0.1)
        with torch.no_grad():
            torch.testing.assert_close(cp(*args), model(*args), rtol=0, atol=0)
    assert len(cp.captures._fronts) == 1
    x, rest = torch.randn(1, 4, 12, 8), {"y": y, "row_pos": torch.arange(6) * 0.3}
    got = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=None, patches=2,
                     model_kwargs=rest, timestep_arg="t")
    want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, model_kwargs=rest,
                          timestep_arg="t")
    assert_kernels_close(got, want, depth=2)


def test_a_row_input_read_along_the_rows_is_refused_naming_it() -> None:
    """``row_pos.flip(0)`` before the repeat: captured with ``row_pos`` as a sequence input,
    no chunk of rows can run alone (the flip mixes the rows): refused naming the input, its
    axis, the guard that pinned the length and the fix."""
    torch.manual_seed(0)
    model = _RowPositionsDiT(DiTConfig(hidden=32, depth=2, n_head=2)).eval()
    model.flip_rows = True
    args = (torch.randn(1, 4, 8, 8), torch.tensor([3]), torch.tensor([1]),
            torch.arange(4) * 0.5 + 0.25)
    with pytest.raises(tppc.CaptureError, match=r"input 'row_pos' axis 0 of _RowPositionsDiT "
                       r"is as long as the example's 4 sequence units .* pins the length "
                       r"\(Guard failed: 4 \* \(x.size\(\)\[2\] // 2\) == 16.*flip.*"
                       r"fix: build row_pos inside the model from the sequence input's size"):
        tppc.compile(model, args, num_stages=2)
