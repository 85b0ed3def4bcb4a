"""The front end: capture with torch.export, then annotate, group and chunk (the passes).

``capture`` traces a model with a symbolic sequence length; ``annotate`` runs the analysis
passes; ``front_end`` is the one path ``tppc.plan``, ``tppc.compile`` and the distributed
runtime share: capture, annotate, group, chunk, and bind a call's inputs to the capture.
"""

from __future__ import annotations

__all__: list[str] = []
