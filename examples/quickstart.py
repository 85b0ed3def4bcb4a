"""Compile a transformers Llama for two CPU stages, run it, and compare with eager.

Run: ``.venv/bin/python examples/quickstart.py``
"""

from __future__ import annotations

import torch

import tppc
from tppc import examples


def main() -> None:
    """Compile, print the plan, run the pipeline, check it, generate a few tokens."""
    model, args, kwargs = examples.hf_llama(seq_len=256, layers=4)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", executor="threads")
    print(cp.plan.summary())
    with torch.inference_mode():
        diff = (cp(*args, **kwargs).logits - model(*args, **kwargs).logits).abs().max()
    print(f"max |pipeline - eager| = {float(diff):.2e}")
    print("generated:", cp.generate(args[0][:, :8], max_new_tokens=8)[0].tolist())


if __name__ == "__main__":
    main()
