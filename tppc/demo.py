"""``tppc demo``: the main job of the quick start, on small models built here."""

from __future__ import annotations

from tppc import examples
from tppc.analysis import annotate
from tppc.inspect import layer_table

__all__ = ["run_demo"]


def run_demo(*, quick: bool = False) -> int:
    """Capture and annotate a small LLM and a small DiT and print their layer tables."""
    for title, factory in (("causal LLM (own GPT)", examples.gpt), ("DiT (own)", examples.dit)):
        model, args, kwargs = factory()
        gm, ctx = annotate(model, args, kwargs)
        print(f"== {title}")
        print(layer_table(gm, ctx))
        print()
    return 0
