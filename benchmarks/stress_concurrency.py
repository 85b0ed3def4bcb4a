"""Concurrency stress: many threads call, generate and compile at once, with new shapes.

Every job picks an entry point and a batch size and length the pipeline has not seen, so most
jobs need a new capture (a new batch shape or input structure) or a new plan (a new length)
while other threads run theirs. Each result is compared with the eager model, each time:

    call           ``cp(ids)`` against ``model(ids)`` (logits, rtol = atol = 1e-5, fp32)
    call_mask      ``cp(ids, attention_mask=m)`` on a left-padded batch (valid positions)
    generate       ``cp.generate(ids, n)`` against an eager greedy loop, token for token
    generate_mask  the same with a left-padded ``attention_mask`` (and HF's position ids)
    denoise        ``cp.denoise`` of tppc's DiT (new batch sizes and latent heights, warm-up on
                   every step: exact) against the serial loop ``model → scheduler.step``
    compile        ``tppc.compile`` of a second model (shared by every compile job) at a
                   random length, then one call against its eager output

The eager oracles run on deep copies taken before anything was compiled (the user's models
are being captured by other threads meanwhile). After the run, the user's models must still
run eagerly (no FakeTensor anywhere in them) and agree with the copies.

Models: transformers' Llama from ``tppc.examples.hf_llama`` (2 layers, compiled at batch 1,
12 tokens, 3 chunks), tppc's own DiT (2 blocks, latents 4×8×8, diffusers' DDIM scheduler)
and tppc's own GPT (2 blocks) as the second model.

Run:  .venv/bin/python benchmarks/stress_concurrency.py [--seconds 120] [--threads 8]
      [--kinds compile,generate_mask]
"""

from __future__ import annotations

import argparse
import copy
import random
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DDIMScheduler  # once here: diffusers' lazy import is not thread-safe

import tppc
from tppc import examples

__all__ = ["KINDS", "Report", "Target", "intact_models", "main", "make_target",
           "model_is_intact", "stress"]

KINDS = ("call", "call_mask", "generate", "generate_mask", "denoise", "compile")
_TOL = 1e-5


@dataclass
class Target:
    """What the threads share: the pipeline, the user's models and their eager copies."""

    cp: Any
    model: torch.nn.Module
    reference: torch.nn.Module
    second: torch.nn.Module
    second_reference: torch.nn.Module
    dit: Any
    dit_model: torch.nn.Module
    dit_reference: torch.nn.Module
    batches: tuple[int, ...] = (2, 3, 4, 5)
    lengths: tuple[int, ...] = tuple(range(4, 25))
    vocab: int = 128

    def shape(self, rng: random.Random) -> tuple[int, int]:
        """A random (batch, length) of the call: batch 1 and 12 tokens were compiled."""
        return rng.choice(self.batches), rng.choice(self.lengths)


@dataclass
class Report:
    """Jobs done per kind, failures (an exception or a mismatch, described), wall time."""

    done: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, failure: str | None) -> None:
        with self.lock:
            self.done[kind] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")


def make_target(**shapes: tuple[int, ...]) -> Target:
    """The Llama pipeline (batch 1, 12 tokens) and the second model, with eager copies;
    ``shapes``: the ``batches`` and ``lengths`` jobs choose from."""
    model, args, _ = examples.hf_llama(seq_len=12, layers=2)
    second, _, _ = examples.gpt(seq_len=8, n_layer=2)
    dit, dit_args, _ = examples.dit(size=8, depth=2)
    target = Target(cp=None, model=model, reference=copy.deepcopy(model), second=second,
                    second_reference=copy.deepcopy(second), dit=None,
                    dit_model=dit, dit_reference=copy.deepcopy(dit), **shapes)
    target.cp = tppc.compile(model, args, chunks=3, executor="threads")
    target.dit = tppc.compile(dit, dit_args, executor="threads")
    return target


def stress(target: Target, *, threads: int, jobs_per_thread: int | None = None,
           seconds: float | None = None, seed: int = 0,
           kinds: tuple[str, ...] = KINDS) -> Report:
    """Run ``threads`` threads of random jobs (a count each, or until ``seconds`` passed)."""
    report = Report()
    barrier = threading.Barrier(threads)
    deadline = None if seconds is None else time.perf_counter() + seconds

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        barrier.wait()
        count = 0
        while (jobs_per_thread is None or count < jobs_per_thread) and \
                (deadline is None or time.perf_counter() < deadline):
            kind = rng.choice(kinds)
            try:
                failure = _JOBS[kind](target, rng)
            except Exception:  # reported, never swallowed
                failure = traceback.format_exc(limit=6)
            report.add(kind, failure)
            count += 1

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    report.seconds = time.perf_counter() - start
    return report


def model_is_intact(model: torch.nn.Module, reference: torch.nn.Module, *inputs: Any
                    ) -> str | None:
    """None when ``model`` holds no fake tensor and runs ``inputs`` eagerly like
    ``reference``."""
    for path, module in model.named_modules():
        for name, value in {**vars(module), **module._parameters, **module._buffers}.items():
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor,
                                                                       torch.nn.Parameter):
                return f"{path}.{name} is a {type(value).__name__}"
    with torch.no_grad():
        got, want = _logits(model(*inputs)), _logits(reference(*inputs))
    if type(got) is not torch.Tensor:
        return f"the eager model returned a {type(got).__name__}"
    if not torch.equal(got, want):
        return f"the eager model differs from its copy by {(got - want).abs().max():.3g}"
    return None


def intact_models(target: Target) -> list[str | None]:
    """:func:`model_is_intact` of the three user models (None each: intact)."""
    ids = torch.randint(1, 128, (3, 7))
    latents = (torch.randn(3, 4, 10, 8), torch.tensor([5, 7, 9]), torch.tensor([1, 2, 3]))
    return [model_is_intact(target.model, target.reference, ids),
            model_is_intact(target.second, target.second_reference, ids),
            model_is_intact(target.dit_model, target.dit_reference, *latents)]


# -- jobs: each returns None or a description of the mismatch -------------------------------
def _call(t: Target, rng: random.Random) -> str | None:
    ids = _ids(t, rng, *t.shape(rng))
    with torch.no_grad():
        return _compare(_logits(t.cp(ids)), _logits(t.reference(ids)), ids.shape)


def _call_mask(t: Target, rng: random.Random) -> str | None:
    ids, mask = _padded(t, rng)
    with torch.no_grad():
        got = _logits(t.cp(ids, attention_mask=mask))
        want = _logits(t.reference(ids, attention_mask=mask))
    valid = mask.bool()
    return _compare(got[valid], want[valid], ids.shape)


def _generate(t: Target, rng: random.Random) -> str | None:
    ids, new = _ids(t, rng, *t.shape(rng)), rng.randint(1, 4)
    got = t.cp.generate(ids, max_new_tokens=new, eos_token_id=None)
    want = _greedy(t.reference, ids, new, None)
    return None if torch.equal(got, want) else f"tokens {got.tolist()} != {want.tolist()}"


def _generate_mask(t: Target, rng: random.Random) -> str | None:
    ids, mask = _padded(t, rng)
    new = rng.randint(1, 4)
    got = t.cp.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None)
    want = _greedy(t.reference, ids, new, mask)
    return None if torch.equal(got, want) else f"tokens {got.tolist()} != {want.tolist()}"


def _denoise(t: Target, rng: random.Random) -> str | None:
    batch, steps = rng.choice(t.batches), rng.randint(1, 2)
    height = 2 * max(2, rng.choice(t.lengths) // 2)  # patch rows: the sequence
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(batch, 4, height, 8, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    got = t.dit.denoise(x, DDIMScheduler(), steps, warmup_steps=steps, model_kwargs={"y": y},
                        timestep_arg="t")
    scheduler = DDIMScheduler()
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for step in scheduler.timesteps:
            out = t.dit_reference(x, step.expand(batch), y)
            x = scheduler.step(out, step, x).prev_sample
    return _compare(got, x, x.shape)


def _compile(t: Target, rng: random.Random) -> str | None:
    batch, length = t.shape(rng)
    example = _ids(t, rng, batch, length, vocab=256)
    cp = tppc.compile(t.second, (example,), chunks=rng.randint(1, 3),
                      executor=rng.choice(["local", "threads"]))
    ids = _ids(t, rng, batch, rng.choice(t.lengths), vocab=256)
    with torch.no_grad():
        return _compare(cp(ids), t.second_reference(ids), ids.shape)


_JOBS = {"call": _call, "call_mask": _call_mask, "generate": _generate,
         "generate_mask": _generate_mask, "denoise": _denoise, "compile": _compile}


def _ids(t: Target, rng: random.Random, batch: int, length: int, vocab: int | None = None
         ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randint(1, vocab or t.vocab, (batch, length), generator=gen)


def _padded(t: Target, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length = t.shape(rng)
    ids = _ids(t, rng, batch, length)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, : rng.randint(0, length - 2)] = 0  # left padding, 2 valid tokens at least
    return ids.masked_fill(mask == 0, 0), mask


def _greedy(model: torch.nn.Module, ids: torch.Tensor, new: int,
            mask: torch.Tensor | None) -> torch.Tensor:
    """Eager greedy decoding, re-running the whole sequence each step (no cache)."""
    with torch.no_grad():
        for _ in range(new):
            kwargs: dict[str, Any] = {"use_cache": False}
            if mask is not None:
                positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
                kwargs.update(attention_mask=mask, position_ids=positions)
            token = model(ids, **kwargs).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
    return ids


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _compare(got: torch.Tensor, want: torch.Tensor, shape: Any) -> str | None:
    if type(got) is not torch.Tensor or got.shape != want.shape:
        return f"input {tuple(shape)}: got {type(got).__name__} {tuple(got.shape)}"
    if torch.allclose(got, want, rtol=_TOL, atol=_TOL):
        return None
    return f"input {tuple(shape)}: max diff {(got - want).abs().max().item():.3g}"


def _count_exports() -> dict[str, int]:
    """Wrap ``torch.export.export`` to count its calls and how many ran at once."""
    counts, lock, real = {"calls": 0, "active": 0, "most": 0}, threading.Lock(), \
        torch.export.export

    def counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            counts["calls"] += 1
            counts["active"] += 1
            counts["most"] = max(counts["most"], counts["active"])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                counts["active"] -= 1

    torch.export.export = counted
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated job kinds to draw from (default: all of {KINDS})")
    ns = parser.parse_args()
    kinds = tuple(k.strip() for k in ns.kinds.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        parser.error(f"--kinds {ns.kinds!r}: unknown {unknown}; choose from {KINDS}")
    torch.set_num_threads(1)
    target = make_target()
    exports = _count_exports()
    report = stress(target, threads=ns.threads, seconds=ns.seconds, seed=ns.seed,
                    kinds=kinds)
    intact = intact_models(target)
    jobs = sum(report.done.values())
    print(f"{jobs} jobs in {report.seconds:.1f} s on {ns.threads} threads: "
          + ", ".join(f"{k} {n}" for k, n in sorted(report.done.items())))
    print(f"torch.export calls: {exports['calls']}, at most {exports['most']} at a time; "
          f"failures: {len(report.failures)}; models intact: {[x or 'yes' for x in intact]}")
    for failure in report.failures[:10]:
        print("FAILURE", failure)
    if report.failures or any(intact):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
