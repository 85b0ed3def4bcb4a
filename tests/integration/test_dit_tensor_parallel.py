"""Tensor parallelism on diffusion transformers (issue 29): warm calls, PipeFusion's stale
patches and the diffusers drop-in, against eager.

Each family is built from a tiny config with random weights and compiled with
``tensor_parallel=2`` (``4`` where the head count allows) on the threads executor; a call
must equal the eager model within the kernel tolerance (a row-parallel projection adds its
partial sums in another order). What the sharding pass leaves whole (an adaLN modulation,
an unpatchify projection) is computed whole on every worker and named in the notes; each test
also checks that the attention and MLP projections it expects cut are cut, so a silently
unsharded family cannot pass. Stale patches on tensor-parallel stages must equal the
single-worker stale run (the same stale K/V, cut by heads), not eager.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tppc
from tests.oracles import assert_kernels_close
from tests.unit.test_meshcut_families import _sana  # the same tiny Sana
from tppc import examples
from tppc.errors import TppcError
from tppc.ir.records import SHARD

diffusers = pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[2]


def _first(out):
    out = out[0] if isinstance(out, tuple | list) else out
    return getattr(out, "sample", out)


def _wan():
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=16, ffn_dim=16, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "encoder_hidden_states": torch.randn(1, 8, 12), "timestep": torch.tensor([10]),
        "return_dict": False}


FAMILIES: dict[str, tuple[Callable, int, tuple[str, ...]]] = {
    # name: (factory, degree, module paths whose linears must be cut)
    "dit": (lambda: examples.dit(depth=2), 4, ("blocks.0.qkv", "blocks.0.proj", "blocks.0.mlp")),
    "pixart": (lambda: examples.hf_pixart(layers=1), 2,
               ("attn1.to_q", "attn1.to_out", "attn2.to_q", "attn2.to_k", "ff.net")),
    "sd3": (lambda: examples.hf_sd3(layers=2), 2,
            ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "ff_context")),
    "hunyuan_dit": (lambda: examples.hf_hunyuan_dit(layers=2), 2,
                    ("attn1.to_q", "attn2.to_k", "ff.net")),
    "cogvideox": (lambda: examples.hf_cogvideox(frames=1, layers=1), 2,
                  ("attn1.to_q", "ff.net")),
    "sana": (_sana, 2, ("attn1.to_q", "attn1.to_v", "attn2.to_k")),
    "wan": (_wan, 2, ("attn1.to_q", "attn1.to_out", "attn2.to_k", "ffn.net")),
}


def _paths(cp, kinds: tuple[str, ...]) -> set[str]:
    """Module paths of the nodes whose shard role is one of ``kinds``."""
    out = set()
    for n in cp._front.annotated.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if SHARD in n.meta and n.meta[SHARD].kind in kinds and stack:
            out.add(list(stack.values())[-1][0])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_warm_call_on_tensor_parallel_workers_equals_eager(family: str) -> None:
    make, degree, cut = FAMILIES[family]
    model, args, kwargs = make()
    with torch.no_grad():
        want = _first(model(*args, **kwargs))
    cp = tppc.compile(model, args, kwargs, cluster=f"{degree}xcpu", num_stages=1,
                      tensor_parallel=degree, executor="threads", verify=False)
    assert len(cp.program(cp.plan.seq_len).workers) == degree
    assert_kernels_close(_first(cp(*args, **kwargs)), want)
    sharded = _paths(cp, ("column", "row"))
    for part in cut:
        assert any(part in p for p in sharded), f"{family}: {part} was not cut ({sharded})"


def test_a_degree_the_head_count_does_not_divide_is_refused_by_name() -> None:
    model, args, kwargs = examples.hf_pixart(layers=1)  # 2 heads
    with pytest.raises(TppcError, match=r"tensor_parallel=4.*(divide|fix)"):
        tppc.compile(model, args, kwargs, cluster="4xcpu", num_stages=1, tensor_parallel=4,
                     verify=False)


FLUX_CUT = ("attn.to_q", "attn.add_q_proj", "single_transformer_blocks.0.proj_mlp",
            "single_transformer_blocks.0.proj_out")


def test_stale_patches_on_tensor_parallel_stages_equal_the_single_worker_run() -> None:
    """Flux (joint attention: the later patches run a program of their own) on 2 stages of 2
    workers: a warm call equals eager; after one warm step the stale patches (K/V cut by
    heads) equal the one-worker stale run, which differs from the warm loop."""
    model, (x,), kwargs = examples.hf_flux(single_layers=1)
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    compiled = {tp: tppc.compile(model, (x,), kwargs, cluster=f"{2 * tp}xcpu", num_stages=2,
                                 tensor_parallel=tp, executor="threads", verify=False)
                for tp in (1, 2)}
    cp = compiled[2]
    assert len(cp.program(cp.plan.seq_len).workers) == 4
    with torch.no_grad():
        assert_kernels_close(_first(cp(x, **kwargs)), _first(model(x, **kwargs)))
    sharded = _paths(cp, ("column", "row"))
    assert all(any(part in p for p in sharded) for part in FLUX_CUT), sharded

    def run(tp: int, warm: int | None) -> torch.Tensor:
        return compiled[tp].denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(), 3,
                                    warmup_steps=warm, patches=2, model_kwargs=kw)

    with torch.no_grad():
        stale, one, warm = run(2, 1), run(1, 1), run(1, None)
    assert_kernels_close(stale, one, depth=3)
    assert not torch.allclose(one, warm, atol=1e-4)  # stale indeed


def test_the_pixart_pipeline_with_tensor_parallel_workers_equals_eager() -> None:
    """``compile_pipeline(pipe, tensor_parallel=2)`` runs the unchanged PixArt pipeline (its
    guided batch of two) on two workers; every step warm, it equals the eager call."""
    pytest.importorskip("tokenizers")
    import tppc.diffusers
    from tests.integration.test_diffusers_dropin import _call, pixart_pipe

    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    want = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=1,
                                    executor="threads", tensor_parallel=2)
    assert_kernels_close(_call(pipe, call, steps=2), want, depth=2)
    (cp,) = pipe.transformer.compiled.values()
    assert [w.rank for w in cp.program(cp.plan.seq_len).workers] == [0, 1]


class _JointBlock(nn.Module):
    """A single-stream joint block (text tokens first): adaLN-zero modulation with a gate, a
    LayerNorm over every query head, a fused K/V unflattened into (2, heads, head dim) and
    unbound, a per-head key RMSNorm, attention beside the MLP columns, one projection of
    both."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ada = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.q_norm, self.k_norm = nn.LayerNorm(d), nn.RMSNorm(d // heads)
        self.mlp = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(3 * d, d)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        shift, scale, gate = self.ada(F.silu(c)).unsqueeze(1).chunk(3, -1)
        h = self.norm(x) * (1 + scale) + shift
        q = self.q_norm(self.q(h)).unflatten(-1, (self.heads, d // self.heads))
        k, v = self.kv(h).unflatten(-1, (2, self.heads, d // self.heads)).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), self.k_norm(k).transpose(1, 2),
                                           v.transpose(1, 2)).transpose(1, 2).flatten(2)
        return x + gate * self.proj(torch.cat([a, F.gelu(self.mlp(h))], dim=-1))


class JointDiT(nn.Module):
    """Text tokens joined before the image tokens, two joint blocks, a modulated head."""

    def __init__(self, d: int = 32, heads: int = 4, text: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.text = nn.Linear(4, d), nn.Linear(text, d)
        self.t_mlp = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(_JointBlock(d, heads) for _ in range(2))
        self.head_ada, self.head = nn.Linear(d, 2 * d), nn.Linear(d, 4)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.text(prompt), self.embed(x)], dim=1)
        c = self.t_mlp(t[:, None].float())
        for block in self.blocks:
            tokens = block(tokens, c)
        shift, scale = self.head_ada(c).unsqueeze(1).chunk(2, -1)
        out = self.head(self.norm(tokens) * (1 + scale) + shift)
        return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("degree", [2, 4])
def test_a_joint_single_stream_dit_of_our_own_is_exact(degree: int) -> None:
    model = JointDiT().eval()
    args = (torch.randn(1, 16, 4), torch.tensor([3.0]), torch.randn(1, 5, 8))
    with torch.no_grad():
        want = model(*args)
    cp = tppc.compile(model, args, cluster=f"{degree}xcpu", num_stages=1,
                      tensor_parallel=degree, executor="threads", verify=False)
    assert_kernels_close(cp(*args), want)
    rows = _paths(cp, ("row",))
    assert {"blocks.0.proj", "blocks.1.proj"} <= rows
    assert {"blocks.0.q", "blocks.0.kv"} <= _paths(cp, ("column",))  # q's norm: all-reduced
    assert "blocks.0.ada" not in _paths(cp, ("column", "row"))  # a modulation: whole


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_gloo_ranks_of_one_tensor_parallel_stage_equal_eager(tmp_path: Path) -> None:
    """PixArt on 2 gloo ranks (``dit_tp_rank.py``), each loading only its shard."""
    from tppc.distributed.checkpoint import save_checkpoint

    model, args, kwargs = examples.hf_pixart()
    save_checkpoint(model, tmp_path / "hf_pixart.safetensors")
    torch.save((args, kwargs), tmp_path / "inputs.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests/integration/dit_tp_rank.py"), str(tmp_path),
         "hf_pixart"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=500)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    with torch.no_grad():
        want = model(*args, **kwargs)[0]
    assert_kernels_close(torch.load(tmp_path / "got.pt"), want)
