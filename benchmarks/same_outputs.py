"""Outputs of the pipelines the benchmarks run, saved so two trees can be compared bit for bit.

Run it in each tree (public API only, so it runs on an older commit too), then compare::

    PYTHONPATH=<tree> .venv/bin/python benchmarks/same_outputs.py save before.pt
    PYTHONPATH=. .venv/bin/python benchmarks/same_outputs.py save after.pt
    .venv/bin/python benchmarks/same_outputs.py compare before.pt after.pt

Pipelines (the pinned CPU calibration of the tests, so both trees make the same plans):
prefill of the project's GPT on the ``threads`` and ``local`` executors, its greedy
``generate``, a transformers Llama, PipeFusion denoising of the project's DiT with stale
patches (2 stages, 2 and 4 patches) and at full warm-up, the exported ONNX Runtime
artifact (threads), and a 2-rank torch.distributed job. ``compare`` prints max|diff| of
each and exits 1 unless every one is 0.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TPPC_CALIBRATION", str(ROOT / "tests/data/cpu_calibration.json"))

import tppc  # noqa: E402
from tppc import examples  # noqa: E402

__all__: list[str] = []


def _logits(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def _prefill(outputs: dict[str, torch.Tensor]) -> None:
    model, (ids,), _ = examples.gpt(seq_len=256)
    for executor in ("threads", "local"):
        cp = tppc.compile(model, (ids,), cluster="2xcpu", executor=executor, num_stages=2)
        with torch.inference_mode():
            outputs[f"gpt prefill {executor}"] = _logits(cp(ids))
            if executor == "threads":
                outputs["gpt generate"] = cp.generate(ids[:, :32], max_new_tokens=8)
    model, (ids,), _ = examples.hf_llama(seq_len=128)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2)
    with torch.inference_mode():
        outputs["llama prefill threads"] = _logits(cp(ids))
    with tempfile.TemporaryDirectory() as tmp:
        model, (ids,), _ = examples.gpt(seq_len=128)
        cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2)
        tppc.export(cp, Path(tmp) / "gpt")
        runner = tppc.load(Path(tmp) / "gpt", threads_per_stage=1)
        outputs["gpt onnxruntime"] = torch.as_tensor(runner(ids.numpy())[0])


def _denoise(outputs: dict[str, torch.Tensor]) -> None:
    from diffusers import DDIMScheduler

    model, args, _ = examples.dit(size=16)
    one = tppc.compile(model, args, executor="local")
    n, length = len(one.context.layers), one.plan.seq_len
    plan = tppc.manual_plan(n, length, cuts=(0, n // 2, n), boundaries=(0, length))
    cp = tppc.compile(model, args, plan=plan, executor="threads", threads_per_stage=1)
    kw = {"y": args[2]}
    for patches in (2, 4):
        outputs[f"dit stale {patches} patches"] = cp.denoise(
            args[0], DDIMScheduler(), 6, warmup_steps=1, patches=patches, model_kwargs=kw,
            timestep_arg="t")
    outputs["dit warm"] = cp.denoise(args[0], DDIMScheduler(), 6, warmup_steps=6,
                                     model_kwargs=kw, timestep_arg="t")


def _distributed(outputs: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    model, (ids,), _ = examples.gpt(seq_len=128)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        result = tppc.launch("tppc.examples:gpt", 2, checkpoint=path, inputs={"args.0": ids},
                             chunks=4, timeout=300)
    outputs["gpt distributed"] = result.outputs["out.0"]


def save(path: str) -> None:
    outputs: dict[str, torch.Tensor] = {}
    for part in (_prefill, _denoise, _distributed):
        part(outputs)
        print(f"[same_outputs] {part.__name__[1:]} done", flush=True)
    torch.save(outputs, path)


def compare(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    bad = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name in b else 'before'}")
            bad += 1
            continue
        same = a[name].shape == b[name].shape and a[name].dtype == b[name].dtype
        diff = (a[name].double() - b[name].double()).abs().max().item() if same else float("nan")
        print(f"{name}: shape {tuple(a[name].shape)}, max|diff| {diff}")
        bad += not (same and diff == 0)
    print("bit-identical" if not bad else f"{bad} outputs differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"]:
        save(sys.argv[2])
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
