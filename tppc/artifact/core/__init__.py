"""The torch-free core of the artifact: what ``tppc.load`` and ``tppc run`` need.

load        ``tppc.load``: schema, hashes and the plan verified before any session exists
check       the checks ``load`` runs on the plan and the stage graphs, and per-call input checks
graph_io    an ONNX graph's inputs and outputs read without onnx
loaded      ``LoadedPipeline``: calls and ``generate`` through ONNX Runtime
assemble    the chunks' rows into full-length outputs, then the model's structure
epilogue    ``tail.onnx``, the model's epilogue after the last stage
run         ``tppc run``: inputs from and outputs to ``.npz``

No module here imports torch, nor at module level any module that does
(tests/unit/test_torch_free_core.py reads every import); ``LoadedPipeline.denoise`` reaches
:mod:`tppc.artifact.torch_runners.denoise` only when called.
"""

from __future__ import annotations

__all__: list[str] = []
