"""Captures of video (and image) DiTs whose Python pins or reshapes the size (issue 21).

Small models of our own, each the construct of a diffusers family, compiled with two stages
and checked against eager (the compile-time validation runs three chunks of unequal size):

- a square video latent whose model pins its size (a Python branch on the patch grid, as
  ``PatchEmbed``'s; Latte, CogVideoX with rope tables), frames in the batch for spatial
  attention and tokens in the batch for temporal attention: captured with the height only;
- an unpatchify whose grid the model computes from the token count in Python (diffusers'
  DiT: ``int(sqrt(tokens))``): the literal reshape is global;
- a patch size ``(time, height, width)`` (Wan's ``(1, 2, 2)``): the height is captured in
  patch rows;
- packed latents with per-token coordinates ``(b, 3, tokens)`` (LTX's ``video_coords``):
  tied to the sequence axis; the same model given the grid as Python ints (LTXPipeline's
  ``num_frames``, ``height``, ``width``) ties the first varying int to the tokens and captures
  again for new values of the others (:mod:`tppc.frontend.size_ints`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close
from tppc.frontend.front_end import bind, read_inputs
from tppc.ir.records import TOKEN


class _Attention(nn.Module):
    """One-head self-attention with a residual over axis 1 of ``(batch, n, d)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v))


class _PinnedSquareVideo(nn.Module):
    """Latte's layout on ``(b, c, f, h, w)``: patchify per frame (frames into the batch), a
    positional table added only when the grid is the sample's (a Python branch that pins the
    size), spatial attention per frame, temporal attention with the tokens in the batch."""

    def __init__(self, c: int = 4, d: int = 16, p: int = 2, sample: int = 8) -> None:
        super().__init__()
        self.config = SimpleNamespace(patch_size=p, in_channels=c)
        self.p, self.grid = p, sample // p
        self.embed = nn.Conv2d(c, d, p, p)
        self.pos = nn.Parameter(torch.randn(1, self.grid**2, d) * 0.1)
        self.spatial = nn.ModuleList(_Attention(d) for _ in range(2))
        self.temporal = nn.ModuleList(_Attention(d) for _ in range(2))
        self.out = nn.Linear(d, p * p * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        t = self.embed(x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w))
        rows, cols = t.shape[-2:]
        t = t.flatten(2).transpose(1, 2)  # (b·f, rows·cols, d)
        if rows == self.grid and cols == self.grid:
            t = t + self.pos
        n = t.shape[1]
        for spatial, temporal in zip(self.spatial, self.temporal, strict=True):
            t = spatial(t)
            t = temporal(t.reshape(b, f, n, -1).permute(0, 2, 1, 3).reshape(b * n, f, -1))
            t = t.reshape(b, n, f, -1).permute(0, 2, 1, 3).reshape(b * f, n, -1)
        y = self.out(t).reshape(b, f, rows, cols, self.p, self.p, c)
        return y.permute(0, 6, 1, 2, 4, 3, 5).reshape(b, c, f, h, w)


class _LiteralGridImage(nn.Module):
    """A DiT whose unpatchify computes its grid from the token count in Python, as diffusers'
    DiT does (``int(sqrt(tokens))``): the size is pinned, the grid a literal in the graph."""

    def __init__(self, c: int = 4, d: int = 16, p: int = 2) -> None:
        super().__init__()
        self.config = SimpleNamespace(patch_size=p, in_channels=c)
        self.p = p
        self.embed = nn.Conv2d(c, d, p, p)
        self.blocks = nn.ModuleList(_Attention(d) for _ in range(2))
        self.out = nn.Linear(d, p * p * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            t = block(t)
        side = int(math.sqrt(t.shape[1]))
        y = self.out(t).reshape(-1, side, side, self.p, self.p, x.shape[1])
        return torch.einsum("nhwpqc->nchpwq", y).reshape(x.shape)


class _TuplePatchVideo(nn.Module):
    """A video DiT with ``config.patch_size = (1, 2, 2)`` (a ``Conv3d`` patch embedding,
    frame-major tokens, joint attention over every frame)."""

    def __init__(self, c: int = 4, d: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(patch_size=(1, 2, 2), in_channels=c)
        self.embed = nn.Conv3d(c, d, (1, 2, 2), (1, 2, 2))
        self.blocks = nn.ModuleList(_Attention(d) for _ in range(2))
        self.out = nn.Linear(d, 4 * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        t = self.embed(x).flatten(2).transpose(1, 2)  # (b, f·rows·cols, d)
        for block in self.blocks:
            t = block(t)
        y = self.out(t).reshape(b, f, h // 2, w // 2, 2, 2, c)
        return y.permute(0, 6, 1, 2, 4, 3, 5).reshape(b, c, f, h, w)


class _CoordsVideo(nn.Module):
    """Packed latents ``(b, f·h·w, c)`` whose positions come from per-token coordinates
    ``(b, 3, tokens)``, or from a grid built from Python ints when none are given (LTX)."""

    def __init__(self, c: int = 8, d: int = 16) -> None:
        super().__init__()
        self.inp, self.pos = nn.Linear(c, d), nn.Linear(3, d)
        self.blocks = nn.ModuleList(_Attention(d) for _ in range(2))
        self.out = nn.Linear(d, c)

    def forward(self, x: torch.Tensor, coords: torch.Tensor | None = None,
                num_frames: int | None = None, height: int | None = None,
                width: int | None = None) -> torch.Tensor:
        if coords is None:
            grid = [torch.arange(n, dtype=torch.float32) for n in (num_frames, height, width)]
            coords = torch.stack(torch.meshgrid(*grid, indexing="ij")).flatten(1)[None]
        t = self.inp(x) + torch.sin(self.pos(coords.transpose(1, 2)))
        for block in self.blocks:
            t = block(t)
        return self.out(t)


def _exact(model: nn.Module, args: tuple, kwargs: dict | None = None) -> tppc.CompiledPipeline:
    kwargs = kwargs or {}
    cp = tppc.compile(model, args, kwargs, num_stages=2, executor="local")
    with torch.no_grad():
        assert_kernels_close(cp(*args, **kwargs), model(*args, **kwargs))
    assert max(len(run.chunks) for run in cp.validation.runs) == 3
    return cp


def test_a_pinned_square_video_is_captured_with_its_height_and_runs_exactly() -> None:
    torch.manual_seed(0)
    cp = _exact(_PinnedSquareVideo().eval(), (torch.randn(1, 4, 2, 8, 8),))
    assert cp.context.capture_mode == "specialized"
    assert cp.context.patch_grid == (2, 4, 4)


def test_a_grid_computed_in_python_makes_its_reshape_global() -> None:
    """The height-only capture of a square latent traces the literal grid ``(-1, 4, 4, ...)``
    with the symbolic shape ``(1, 4, s, ...)``: taken as row-wise, chunks crashed in it."""
    torch.manual_seed(0)
    model, x = _LiteralGridImage().eval(), torch.randn(1, 4, 8, 8)
    cp = _exact(model, (x,))
    assert cp.context.capture_mode == "specialized"
    gm, _ctx = tppc.annotate(model, (x,))
    literal = [n for n in gm.graph.nodes if n.op == "call_function"
               and "reshape" in str(n.target) and n.args[1][1:3] == [4, 4]]
    assert literal and {n.meta[TOKEN].role for n in literal} == {"global"}


def test_a_time_height_width_patch_size_captures_patch_rows() -> None:
    torch.manual_seed(0)
    cp = _exact(_TuplePatchVideo().eval(), (torch.randn(1, 4, 2, 8, 8),))
    assert (cp.context.capture_mode, cp.context.patch_size) == ("dynamic", 2)
    assert cp.context.example_seq == 4  # patch rows, not the 8 pixel rows


def test_per_token_coordinates_are_tied_to_the_sequence_axis() -> None:
    torch.manual_seed(0)
    model = _CoordsVideo().eval()
    grid = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(4.0), torch.arange(4.0),
                                      indexing="ij")).flatten(1)[None]
    cp = _exact(model, (torch.randn(1, 32, 8), grid))
    assert cp.context.capture_mode == "dynamic"
    assert cp.context.seq_inputs == {"x": (1,), "coords": (2,)}


def test_a_grid_of_python_ints_runs_at_every_grid_a_user_calls() -> None:
    """Was refused ("integer input num_frames=..., height=..., width=..."): the rope grid is
    built from Python ints, which torch.export keeps constant."""
    torch.manual_seed(0)
    model = _CoordsVideo().eval()
    cp = _exact(model, (torch.randn(1, 24, 8),), {"num_frames": 4, "height": 2, "width": 3})
    unit = cp.context.size_int
    assert (cp.context.capture_mode, unit.label, unit.per_unit) == ("dynamic", "num_frames", 6)
    assert "num_frames of num_frames=4, height=2, width=3" in tppc.layer_table(
        cp.captures.example.annotated, cp.context)
    for f, h, w in ((5, 2, 3), (1, 4, 3)):  # frames: the same capture; one frame: a new one
        x, grid = torch.randn(1, f * h * w, 8), {"num_frames": f, "height": h, "width": w}
        with torch.no_grad():
            torch.testing.assert_close(cp(x, **grid), model(x, **grid), rtol=0, atol=0)
    assert len(cp.captures._fronts) == 2
    with pytest.raises(tppc.RuntimeInputError, match=r"num_frames=5, height=2, width=3 do not "
                       r"multiply to the 24 tokens of 'x'"):
        cp(torch.randn(1, 24, 8), num_frames=5, height=2, width=3)
    call = read_inputs(model, (torch.randn(1, 24, 8),), {"num_frames": 3, "height": 2,
                                                         "width": 3})
    with pytest.raises(tppc.RuntimeInputError, match=r"input num_frames is 3, but the 24 tokens"):
        bind(cp.captures.example, model, call)  # the int it reads from the tokens, checked


def test_diffusers_ltx_with_python_ints_runs_at_every_grid_a_user_calls() -> None:
    """``LTXVideoTransformer3DModel`` called as ``LTXPipeline`` calls it (the grid as Python
    ints, issue 30): more frames reuse the capture, a new width is captured again, and the
    example's grid after it runs on its own capture again (never shortened to the wider
    grid's units); each exact against eager."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, num_layers=2, caption_channels=12).eval()
    text = {"encoder_hidden_states": torch.randn(1, 6, 12), "timestep": torch.tensor([10]),
            "encoder_attention_mask": torch.ones(1, 6), "return_dict": False}
    grid = {"num_frames": 2, "height": 4, "width": 4}
    cp = tppc.compile(model, (torch.randn(1, 32, 8),), {**text, **grid}, num_stages=2)
    assert cp.context.size_int.label == "num_frames"
    for f, h, w in ((3, 4, 4), (2, 4, 6), (2, 4, 4)):
        x, kwargs = torch.randn(1, f * h * w, 8), {**text, "num_frames": f, "height": h,
                                                   "width": w}
        with torch.no_grad():
            torch.testing.assert_close(cp(x, **kwargs)[0], model(x, **kwargs)[0], rtol=0,
                                       atol=0)
    assert len(cp.captures._fronts) == 2
