"""The ``backend=`` dispatch of ``tppc.compile`` above both pipelines.

``compile`` ``tppc.compile``: capture, plan and validate for the in-process pipeline, or hand
the model to the distributed one.
"""

from __future__ import annotations

__all__: list[str] = []
