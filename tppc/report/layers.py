"""Human-readable views of an annotated graph: the layer table."""

from __future__ import annotations

from collections import Counter

from torch import fx

from tppc.ir.context import CompileContext
from tppc.ir.records import TOKEN

__all__ = ["layer_table"]


def layer_table(gm: fx.GraphModule, ctx: CompileContext) -> str:
    """A table of the layers of an annotated graph: nodes, parameters, attention, roles."""
    by_name = {n.name: n for n in gm.graph.nodes}
    header = f"{'#':>3}  {'layer':<28} {'kind':<9} {'nodes':>5} {'params':>10} {'MB':>8}  " \
             f"{'attention':<14} roles"
    lines = [
        f"{ctx.model_name}: capture {ctx.capture_mode}, sequence symbol {ctx.seq_symbol} "
        f"(example {ctx.example_seq}), tokens = {ctx.token_count}",
        header, "-" * len(header),
    ]
    for layer in ctx.layers:
        roles = Counter(by_name[n].meta[TOKEN].role for n in layer.nodes)
        role_text = " ".join(f"{r}={roles[r]}" for r in
                             ("token", "mixing", "positional", "const", "global") if roles[r])
        attn = ",".join(sorted(set(layer.attention_kinds))) or "-"
        lines.append(
            f"{layer.index:>3}  {layer.name:<28} {layer.kind:<9} {len(layer.nodes):>5} "
            f"{layer.param_count:>10,} {layer.param_bytes / 1e6:>8.3f}  {attn:<14} {role_text}"
        )
    total = sum(layer.param_count for layer in ctx.layers)
    lines.append(f"{len(ctx.layers)} layers, {total:,} parameters (shared ones counted per layer)")
    if ctx.size_int is not None:
        lines.append(f"note: {ctx.size_int.note}")
    if ctx.specialization:
        lines.append(f"note: torch.export specialised the sequence length: {ctx.specialization}")
    return "\n".join(lines)
