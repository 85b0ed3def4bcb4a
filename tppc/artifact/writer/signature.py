"""The model's input/output signature as JSON (``plan.json["signature"]``; no pickle).

Terms:
    input entry: one flat user input: a tensor (``dtype``, ``shape`` with ``null`` on its
        sequence axes and on axes that follow it (a square latent's width; ``int()`` of
        one would specialise the capture's symbol), ``seq_axes``, ``seq_rows``: positions per unit of the sequence on
        each, a latent's patch size, 1 for tokens) or a fixed value (``value``: a JSON scalar) that the
        capture specialised on (``use_cache=False``).
    tree: a pytree structure in JSON: ``{"type": "leaf"}``, ``{"type": "tuple"|"list",
        "children": [...]}``, ``{"type": "dict", "keys": [...], "children": [...]}``, or a
        named mapping (``{"type": "mapping", "class": "CausalLMOutputWithPast", "keys":
        [...], "children": [...]}``, what HF ModelOutputs flatten to).
"""

from __future__ import annotations

from typing import Any

import torch

from tppc.artifact.writer.graphs import ExportError
from tppc.pipeline.cache_resets import cache_reset_length
from tppc.program.patches import rows_per_unit

__all__ = ["model_signature", "tree_json"]


def _rows_per_unit(front: Any, size: Any) -> int:
    """Positions per unit of a sequence axis: a block scan's ``k`` (its length is captured
    as ``k × blocks``; the example's capture may hold the static size), else as the
    capture records it."""
    block = getattr(front.ctx, "block_size", None)
    return int(block) if block is not None else rows_per_unit(size)


def model_signature(compiled: Any, program: Any) -> dict[str, Any]:
    """The signature of ``compiled``'s captured model (see the module docstring)."""
    front = compiled._front  # the example's capture (batch shape and sequence axes)
    inputs = []
    for ph in front.placeholders:
        val = ph.meta.get("val")
        seq = sorted(front.ctx.seq_inputs.get(ph.name, ()))
        if isinstance(val, torch.Tensor):
            inputs.append({"name": ph.name, "dtype": str(val.dtype).removeprefix("torch."),
                           "shape": [None if i in seq or isinstance(s, torch.SymInt)
                                     else int(s) for i, s in enumerate(val.shape)],
                           "seq_axes": seq, "seq_rows": [_rows_per_unit(front, val.shape[a])
                                                         for a in seq]})
        elif val is None or isinstance(val, (bool, int, float, str)):
            inputs.append({"name": ph.name, "value": val})
        else:
            raise ExportError(f"input {ph.name!r} is a {type(val).__name__}; tppc exports "
                              "tensor inputs and JSON scalars only")
    sig = program.signature
    logits = next((j for j, a in enumerate(sig.output_axes) if a is not None), None)
    token_inputs = [i for i, e in enumerate(inputs) if e.get("seq_axes")]
    return {
        "inputs": inputs,
        "in_spec": tree_json(sig.in_spec),
        "outputs": [{"axis": a, **_rows(sig.output_rows, j)}
                    for j, a in enumerate(sig.output_axes)],
        "out_spec": tree_json(sig.out_spec),
        "generate": {
            "token_input": token_inputs[0] if len(token_inputs) == 1 else None,
            "logits_output": logits,
            "eos_token_id": _ids(compiled.eos_token_id),
            "pad_token_id": _ids(compiled.pad_token_id),
            "length_tables": list(sig.length_tables),
            "cache_reset": cache_reset_length(compiled.model) if sig.length_tables else None,
        },
    }


def tree_json(spec: Any) -> dict[str, Any]:
    """A torch pytree ``TreeSpec`` as JSON (``None``: a single leaf)."""
    if spec is None or spec.is_leaf():
        return {"type": "leaf"}
    kids = spec.children() if hasattr(spec, "children") else spec.children_specs
    children = [tree_json(c) for c in kids]
    if spec.type in (tuple, list):
        return {"type": spec.type.__name__, "children": children}
    keys = spec.context
    if spec.type is dict or (isinstance(keys, (list, tuple)) and len(keys) == len(children)
                             and all(isinstance(k, str) for k in keys)):
        kind = "dict" if spec.type is dict else "mapping"
        entry = {"type": kind, "keys": list(keys), "children": children}
        if kind == "mapping":
            entry["class"] = spec.type.__name__
        return entry
    raise ExportError(f"outputs of type {spec.type.__name__} cannot be described in JSON; "
                      "fix: return tensors, tuples, lists, dicts or HF ModelOutputs")


def _rows(rows: Any, j: int) -> dict[str, int]:
    """``scale`` and ``prefix`` of output ``j``'s token axis (positions per unit, unsplit
    rows before them)."""
    found = rows[j] if j < len(rows) and rows[j] else (1, 0)
    return {"scale": int(found[0]), "prefix": int(found[1])}


def _ids(value: Any) -> Any:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return [int(v) for v in value]
