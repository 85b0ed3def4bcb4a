"""An exported program made ready for tppc's passes: its output dataclasses registered with
pytree, and its in-place writes functionalised (every reader sees the value it reads)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc.errors import CaptureError

__all__ = ["functional", "refuse_weight_writes", "register_dataclasses"]


def register_dataclasses(output: Any) -> None:
    """Register with torch.export every dataclass in a model's output that pytree does not
    know (``torch.export.register_dataclass``; process-wide, as a user would), so that a
    ``forward`` returning one is captured and each call returns the same dataclass. Called
    by a forward hook on the traced module (the shadow tree's: the model keeps no hook)."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        if type(output) not in pytree.SUPPORTED_NODES:
            torch.export.register_dataclass(type(output))
        children: Any = [getattr(output, f.name) for f in dataclasses.fields(output)]
    elif isinstance(output, list | tuple):
        children = output
    elif isinstance(output, dict):
        children = output.values()
    else:
        return
    for child in children:
        register_dataclasses(child)


def functional(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` with every in-place write made out-of-place when it has any (functionalisation,
    no decomposition): a value made inside the graph (``new_empty``, ``zeros_like``,
    ``clone``...) and then written through views (``x[..., :r] = f(...)``, ``copy_``,
    ``index_put_``, ``scatter_``) becomes one chain of values (``slice_scatter``,
    ``index_put``, ``scatter``), each the previous one with the write applied, so that every
    later pass sees what each reader reads."""
    if not any(_mutates(n) for gm in ep.graph_module.modules() if isinstance(gm, fx.GraphModule)
               for n in gm.graph.nodes):  # a write under torch.no_grad() is in a submodule
        return ep
    ep = ep.run_decompositions({})
    for node in ep.graph.nodes:  # functionalisation turns reshapes into views that hold only
        if node.target in _VIEWS:  # for the example's strides; a chunk's may differ
            node.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    return ep


def refuse_weight_writes(ep: torch.export.ExportedProgram, model: str) -> None:
    """Refuse a ``forward`` that writes a parameter in place: the compiled program runs the
    same graph at every call, so a one-time write (transformers' RWKV divides its output
    weights on its first call in eval mode, ``_rescale_layers``) would repeat.

    Raises:
        CaptureError: naming the parameters, the line that writes them, and the fix.
    """
    kind = torch.export.graph_signature.OutputKind.PARAMETER_MUTATION
    written = [spec.target for spec in ep.graph_signature.output_specs if spec.kind == kind]
    if not written:
        return
    output = next(n for n in ep.graph.nodes if n.op == "output")
    values = [v for v, spec in zip(output.args[0], ep.graph_signature.output_specs,
                                   strict=False) if spec.kind == kind]
    traces = [(v.meta.get("stack_trace") or "").strip() for v in values
              if isinstance(v, fx.Node)]
    lines = [t.splitlines()[-2:] for t in traces if t and "<eval_with_key>" not in t]
    where = f" ({' '.join(ln.strip() for ln in lines[0])})" if lines else \
        " (under torch.no_grad(), which records no line)"
    raise CaptureError(
        f"{model}'s forward writes {len(written)} parameter(s) in place{where}: "
        f"{', '.join(written[:4])}{' …' if len(written) > 4 else ''}; the compiled program "
        "runs one graph at every call, so the write would repeat at each. fix: run the model "
        "once before tppc.compile so that its one-time write is done (transformers' RWKV "
        "rescales its weights on its first call in eval mode: `with torch.no_grad(): "
        "model(ids)`), or write the weights outside forward")


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable
