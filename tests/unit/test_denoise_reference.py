"""PipeFusion's stale-K/V rule, checked against an independent reference to 1e-5.

The reference below is a plain loop over steps and patches written from the project's DiT
modules (not from tppc's graphs), with explicit K/V buffers per block:

- warm-up steps run the whole image and write every row of every buffer;
- in a pipelined step, patch ``m`` writes its own K/V rows, then attends to the whole buffer:
  rows of patches ``<= m`` hold this step's values, rows of later patches the previous
  step's (they were written by the same patch one step before);
- the scheduler steps each patch's rows as that patch leaves the model.

The test can fail: ``test_a_broken_rule_is_caught`` runs the reference with a mutated rule
(later patches read the *warm-up* step's K/V, not the previous step's) and shows that it
differs from tppc's result by far more than the tolerance; a tppc that implemented that rule
would fail ``test_pipefusion_equals_the_reference``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, two_stage_plan
from tppc import examples

diffusers = pytest.importorskip("diffusers")


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
    ang = pos.float()[:, None] * freq[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class Reference:
    """The DiT run patch by patch with explicit K/V buffers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> None:
        self.model, self.labels = model, labels
        self.p = model.patch_size
        self.b, self.ch, self.h, self.w = x.shape
        self.hp, self.wp = self.h // self.p, self.w // self.p
        self.keys: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(model.blocks)

    def rows(self, x: torch.Tensor, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The model's output for patch rows ``[a, b)``; writes their K/V rows."""
        m, wp = self.model, self.wp
        tok = m.patch(x).flatten(2).transpose(1, 2)
        d = tok.shape[-1]
        rows = torch.arange(self.hp).repeat_interleave(wp)
        cols = torch.arange(wp).repeat(self.hp)
        tok = tok + torch.cat([_sincos(rows, d // 2), _sincos(cols, d // 2)], dim=-1)[None]
        tok = tok[:, a * wp:b * wp]
        c = m.t_mlp(_sincos(t, d)) + m.y_emb(self.labels)
        for layer, blk in enumerate(m.blocks):
            tok = self._block(layer, blk, tok, c, a * wp, b * wp)
        shift, scale = m.ada_f(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        tok = m.out(m.norm_f(tok) * (1 + scale) + shift)
        p = self.p
        tok = tok.view(self.b, b - a, wp, p, p, self.ch).permute(0, 5, 1, 3, 2, 4)
        return tok.reshape(self.b, self.ch, (b - a) * p, self.w)

    def _block(self, layer: int, blk: torch.nn.Module, x: torch.Tensor, c: torch.Tensor,
               start: int, end: int) -> torch.Tensor:
        n, d, heads = x.shape[1], x.shape[2], blk.n_head
        sh1, sc1, g1, sh2, sc2, g2 = blk.ada(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        y = blk.norm1(x) * (1 + sc1) + sh1
        q, k, v = (z.view(self.b, n, heads, d // heads).transpose(1, 2)
                   for z in blk.qkv(y).split(d, dim=2))
        if self.keys[layer] is None:
            shape = (self.b, heads, self.hp * self.wp, d // heads)
            self.keys[layer], self.values[layer] = torch.zeros(shape), torch.zeros(shape)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        att = F.scaled_dot_product_attention(q, self.keys[layer], self.values[layer])
        x = x + g1 * blk.proj(att.transpose(1, 2).reshape(self.b, n, d))
        return x + g2 * blk.mlp(blk.norm2(x) * (1 + sc2) + sh2)

    def denoise(self, x: torch.Tensor, steps: int, warmup: int, patches: int,
                stale_from: str = "previous step") -> torch.Tensor:
        """``steps`` DDIM steps, the first ``warmup`` on the whole image, then ``patches``
        equal bands of patch rows. ``stale_from="warm-up"`` is the broken rule."""
        sched = diffusers.DDIMScheduler()
        sched.set_timesteps(steps)
        bands = [round(i * self.hp / patches) for i in range(patches + 1)]
        snapshot = None
        for i, t in enumerate(sched.timesteps):
            tt = t.expand(self.b)
            if i < warmup:
                x = sched.step(self.rows(x, tt, 0, self.hp), t, x).prev_sample
                snapshot = ([k.clone() for k in self.keys], [v.clone() for v in self.values])
                continue
            if stale_from == "warm-up":
                self.keys = [k.clone() for k in snapshot[0]]
                self.values = [v.clone() for v in snapshot[1]]
            new = x.clone()
            for a, b in itertools.pairwise(bands):
                lo, hi = a * self.p, b * self.p
                out = self.rows(x, tt, a, b)
                new[:, :, lo:hi] = sched.step(out, t, x[:, :, lo:hi]).prev_sample
            x = new
        return x


@pytest.fixture(scope="module")
def dit():
    model, args, kwargs = examples.dit(size=16)
    plan = two_stage_plan(tppc.compile(model, args, kwargs, executor="local"))  # 8 rows
    return model, args, {ex: tppc.compile(model, args, kwargs, executor=ex, plan=plan)
                         for ex in ("local", "threads")}


def _tppc(cp, args, steps, warmup, patches):
    x, _, labels = args
    return cp.denoise(x, diffusers.DDIMScheduler(), steps, warmup_steps=warmup,
                      patches=patches, model_kwargs={"y": labels}, timestep_arg="t")


@pytest.mark.parametrize("executor", ["local", "threads"])
@pytest.mark.parametrize(("steps", "warmup", "patches"), [(4, 1, 2), (5, 2, 3), (3, 3, 2)])
def test_pipefusion_equals_the_reference(dit, executor, steps, warmup, patches):
    model, args, cps = dit
    with torch.no_grad():
        ref = Reference(model, args[0], args[2]).denoise(args[0], steps, warmup, patches)
        got = _tppc(cps[executor], args, steps, warmup, patches)
    assert_kernels_close(got, ref, depth=steps)


def test_a_broken_rule_is_caught(dit):
    model, args, cps = dit
    with torch.no_grad():
        broken = Reference(model, args[0], args[2]).denoise(args[0], 4, 1, 2,
                                                            stale_from="warm-up")
        got = _tppc(cps["local"], args, 4, 1, 2)
    assert (got - broken).abs().max() > 1e-3
