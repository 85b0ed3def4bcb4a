"""The artifact's writer: a compiled pipeline as ``plan.json`` and one ONNX file per stage.

write           ``tppc.export``: the files, their hashes, the plan
graphs          the export stage graphs and their K/V interface
to_onnx         tppc's fx -> ONNX translator, over the op tables ``onnx_ops`` (GPT-style LMs),
                ``onnx_mask_ops`` (masks and attention biases), ``onnx_dit_ops`` (DiTs)
signature       the model's input/output signature as JSON
export_check    the written artifact run through ONNX Runtime against the compiled pipeline

Needs torch; reads :mod:`tppc.artifact.core` (the schema, the loader the check runs).
"""

from __future__ import annotations

__all__: list[str] = []
