"""Plan a Llama-70B-shaped model on 8×H100 at 32k tokens without allocating its weights.

Run: ``.venv/bin/python examples/plan_llama70b.py [cluster] [seq_len] [gantt.png]``
(the front page's picture: ``examples/plan_llama70b.py 4xh100-sxm 8192 docs/img/plan.png``).
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tppc


def main(cluster: str = "8xh100-sxm", seq_len: int = 32768, png: str | None = None) -> None:
    """Build the model on the meta device, plan it, print the plan (and draw it to ``png``)."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, 256))
    plan = tppc.plan(model, (ids,), cluster=cluster, seq_len=seq_len, granularity=128,
                     verbose=True)
    print(plan.summary())
    if png:
        print(f"Gantt chart written to {tppc.plan_timeline(plan, png)}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["8xh100-sxm"]), *(int(a) for a in sys.argv[2:3]), *sys.argv[3:4])
