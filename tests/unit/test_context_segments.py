"""Context segments on either side of the split tokens (issue 21: SD3's text after the image).

Own toy MM-DiTs, checked against eager and the serial denoising loop: the text after the
image tokens cut apart by ``split`` (a form no diffusers model uses), and text between two
bands of image tokens, refused by name.
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


class _TextAfter(nn.Module):
    """Two-stream joint attention, text tokens after the image tokens, split apart again."""

    def __init__(self, d: int = 16, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.img_in, self.txt_in = nn.Linear(4, d), nn.Linear(6, d)
        self.time = nn.Linear(1, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(depth))
        self.txt_mlp = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        b, d = x.shape[0], self.out.in_features
        h = self.img_in(x) + self.time(t.float()[:, None])[:, None]
        e = self.txt_in(text)
        for qkv, mlp in zip(self.qkv, self.txt_mlp, strict=True):
            joint = torch.cat([h, e], dim=1)  # [image | text]
            q, k, v = qkv(joint).view(b, -1, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, d)
            img, txt = a.split([h.shape[1], e.shape[1]], dim=1)
            h, e = h + img, e + mlp(txt)
        return self.out(h)


class _TextBetween(nn.Module):
    """Text tokens between two image streams: ``cat([image, text, image'])``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.txt = nn.Linear(4, d), nn.Linear(4, d), nn.Linear(6, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for block in self.blocks:
            joint = block(torch.cat([h, self.txt(text), self.b(x)], dim=1))[:, None]
            h = h + F.scaled_dot_product_attention(joint, joint, joint)[:, 0, : x.shape[1]]
        return h


@pytest.fixture(scope="module")
def text_after():
    """The model, its example and its two-stage pipeline (one compile for the module)."""
    torch.manual_seed(0)
    model = _TextAfter().eval()
    args = (torch.randn(1, 12, 4), torch.tensor([10]), torch.randn(1, 5, 6))
    return model, args, tppc.compile(model, args, num_stages=2, executor="threads")


def test_text_after_the_image_is_a_suffix_of_every_kv_buffer(text_after) -> None:
    model, args, cp = text_after
    assert cp.context.token_count.subs(cp.context.seq_symbol, 12) == 12
    stages = cp.program(cp.plan.seq_len).stages
    assert len(stages) == 2
    buffers = [b for stage in stages for b in stage.buffers]
    assert len(buffers) == 4  # K and V of two joint attentions
    assert {(b.prefix, b.scale, b.suffix, b.rows(12)) for b in buffers} == {(0, 1, 5, 17)}
    with torch.no_grad():
        assert_kernels_close(cp(*args), model(*args))


def test_text_after_the_image_denoises_exactly_with_every_step_warm(text_after) -> None:
    model, (x, _, text), cp = text_after
    ref = serial_denoise(model, x, diffusers.DDIMScheduler(), 3, timestep_arg="t",
                         model_kwargs={"text": text})
    for patches in (2, 3):  # the first patch of a step carries the text, the others do not
        exact = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=3, patches=patches,
                           model_kwargs={"text": text}, timestep_arg="t")
        assert_kernels_close(exact, ref, depth=3)
    stale = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=1, patches=3,
                       model_kwargs={"text": text}, timestep_arg="t")
    assert torch.isfinite(stale).all() and not torch.equal(stale, ref)


def test_text_between_two_image_streams_is_refused_by_name() -> None:
    model = _TextBetween().eval()
    with pytest.raises(AnnotationError, match="cat of two segments with split tokens"):
        tppc.annotate(model, (torch.randn(1, 12, 4), torch.randn(1, 5, 6)))


class _ImageQueries(nn.Module):
    """Image queries over joint keys ``[image | text]``: each K/V buffer takes the segments
    of its own keys, not the queries'."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.img, self.txt, self.out = nn.Linear(4, d), nn.Linear(6, d), nn.Linear(d, 4)
        self.q = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.kv = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(2))

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h, e = self.img(x) + t.float()[:, None, None], self.txt(text)
        for q, kv in zip(self.q, self.kv, strict=True):
            k, v = kv(torch.cat([h, e], dim=1)).unsqueeze(1).chunk(2, dim=-1)
            h = h + F.scaled_dot_product_attention(q(h).unsqueeze(1), k, v).squeeze(1)
        return self.out(h)


def test_image_queries_over_text_after_the_image_keys() -> None:
    torch.manual_seed(0)
    model = _ImageQueries().eval()
    args = (torch.randn(1, 12, 4), torch.tensor([3]), torch.randn(1, 5, 6))
    cp = tppc.compile(model, args, num_stages=2)
    with torch.no_grad():
        assert_kernels_close(cp(*args), model(*args))
    buffers = [b for stage in cp.program(12).stages for b in stage.buffers]
    assert {(b.prefix, b.suffix) for b in buffers} == {(0, 5)}
    # stale patches: the first call checks the patch program against the one-chunk program
    out = cp.denoise(args[0], diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=2,
                     model_kwargs={"text": args[2]}, timestep_arg="t")
    assert torch.isfinite(out).all()


class _TextAfterCutFromTheEnd(_TextAfter):
    """The same, the segments cut back by counting from the end (``a[:, :-text]``,
    ``a[:, -text:]``, as HunyuanVideo does): negative slice indices."""

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        b, d, n = x.shape[0], self.out.in_features, text.shape[1]
        h = self.img_in(x) + self.time(t.float()[:, None])[:, None]
        e = self.txt_in(text)
        for qkv, mlp in zip(self.qkv, self.txt_mlp, strict=True):
            joint = torch.cat([h, e], dim=1)
            q, k, v = qkv(joint).view(b, -1, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, d)
            h, e = h + a[:, :-n], e + mlp(a[:, -n:])
        return self.out(h)


def test_segments_cut_back_counting_from_the_end_are_exact() -> None:
    """A negative slice end was read as a position (a prefix of -5: the next op global)."""
    torch.manual_seed(0)
    model = _TextAfterCutFromTheEnd().eval()
    args = (torch.randn(1, 12, 4), torch.tensor([10]), torch.randn(1, 5, 6))
    cp = tppc.compile(model, args, num_stages=2, executor="threads")
    with torch.no_grad():
        assert_kernels_close(cp(*args), model(*args))
