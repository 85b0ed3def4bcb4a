"""``tppc demo``: the main job of the quick start, on small models built here.

For a causal LLM (the project's GPT, and transformers' Llama when installed): compile for
``2xcpu`` (capture, annotate, price, plan), print the plan, run the pipeline with the
``threads`` executor, check it against the eager model, and check greedy generation token for
token. For a DiT: print the layer table of a small one; when diffusers is installed, compile
it for ``2xcpu`` and denoise with PipeFusion (``cp.denoise``), checking that warm-up on every
step equals the serial loop and printing the PSNR of one warm-up step; then plan a
DiT-XL/2-shaped model (built on the meta device, no weights) for 20 denoising steps of a
1024-pixel image on four A100s joined by PCIe.
Exits non-zero when a check fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.driver.planning import plan
from tppc.examples.models import GPT, DiT, DiTConfig, GPTConfig
from tppc.frontend.annotate import annotate
from tppc.planner import Workload
from tppc.report.layers import layer_table

__all__ = ["run_demo"]

_TOLERANCE = 1e-4


def run_demo(*, quick: bool = False) -> int:
    """Run the demo; returns 0 when every check passes, 1 otherwise."""
    failures = 0
    seq = 256 if quick else 1024
    llms: list[tuple[str, Callable[[], tuple[Any, tuple, dict]]]] = [
        ("own GPT", lambda: _gpt(seq)),
    ]
    if _has("transformers"):
        llms.append(("transformers LlamaForCausalLM", lambda: examples.hf_llama(seq_len=seq // 4)))
    for title, factory in llms:
        failures += _causal_lm(title, *factory())
    failures += _dit()
    print("demo:", "all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


def _gpt(seq: int) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=2048, n_layer=6, n_head=8, n_embd=256, max_seq=2 * seq)
    return GPT(cfg).eval(), (torch.randint(0, 2048, (1, seq)),), {}


def _causal_lm(title: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    print(f"== {title}: compile for 2xcpu, run the pipeline, compare with eager")
    start = time.perf_counter()
    cp = compile_pipeline(model, args, kwargs, cluster="2xcpu", executor="threads")
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    print(cp.plan.summary())
    with torch.inference_mode():
        expected = _logits(model(*args, **kwargs))
        got = _logits(cp(*args, **kwargs))
    err = float((got - expected).abs().max())
    ok = err <= _TOLERANCE
    print(f"pipeline vs eager: max |difference| = {err:.2e} ({'ok' if ok else 'FAILED'})")
    ids = args[0][:, :16]
    new = cp.generate(ids, max_new_tokens=8)
    ref = _greedy(model, ids, 8)
    same = torch.equal(new, ref)
    print(f"greedy generate, 8 new tokens: {'equal to eager' if same else 'DIFFERENT'} "
          f"{new[0, -8:].tolist()}\n")
    return int(not ok) + int(not same)


def _greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> torch.Tensor:
    out = ids
    with torch.inference_mode():
        for _ in range(steps):
            logits = _logits(model(out))
            out = torch.cat([out, logits[:, -1:].argmax(-1)], dim=1)
    return out


def _dit() -> int:
    print("== DiT (own): layer table of a small one")
    model, args, kwargs = examples.dit(size=32)
    gm, ctx = annotate(model, args, kwargs)
    print(layer_table(gm, ctx))
    failures = _denoise(model, args) if _has("diffusers") else 0
    print("\n== DiT-XL/2 shape on the meta device: 20 steps at 1024 px on 4xa100-80gb@pcie4")
    with torch.device("meta"):
        big = DiT(DiTConfig(hidden=1152, depth=28, n_head=16)).eval()
    latents = (torch.randn(1, 4, 128, 128), torch.tensor([10]), torch.tensor([3]))
    workload = Workload(kind="diffusion", steps=20, warmup_steps=1)
    result = plan(big, latents, cluster="4xa100-80gb@pcie4", workload=workload)
    print(result.summary())
    ok = result.latency >= result.lower_bound > 0
    print(f"plan check: latency >= lower bound > 0 ({'ok' if ok else 'FAILED'})\n")
    return int(not ok) + failures


def _denoise(model: torch.nn.Module, args: tuple) -> int:
    from diffusers import DDIMScheduler

    print("\n== DiT (own): compile for 2xcpu, denoise 6 DDIM steps with PipeFusion")
    cp = compile_pipeline(model, args, {}, cluster="2xcpu", executor="threads")
    x, kw, steps = args[0], {"y": args[2]}, 6
    serial = DDIMScheduler()
    serial.set_timesteps(steps)
    ref = x
    with torch.inference_mode():
        for t in serial.timesteps:
            ref = serial.step(model(ref, t.expand(len(ref)), **kw), t, ref).prev_sample
    exact = cp.denoise(x, DDIMScheduler(), steps, warmup_steps=steps, patches=2,
                       model_kwargs=kw, timestep_arg="t")
    err = float((exact - ref).abs().max())
    ok = err <= _TOLERANCE
    print(f"warm-up on every step vs the serial loop: max |difference| = {err:.2e} "
          f"({'ok' if ok else 'FAILED'})")
    stale = cp.denoise(x, DDIMScheduler(), steps, warmup_steps=1, patches=2,
                       model_kwargs=kw, timestep_arg="t")
    mse = float(((stale - ref) ** 2).mean())
    psnr = 10 * torch.log10(ref.abs().max() ** 2 / max(mse, 1e-30)).item()
    print(f"1 warm-up step, 2 patches (one-step-stale K/V): MSE {mse:.2e}, PSNR {psnr:.1f} dB")
    return int(not ok)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
