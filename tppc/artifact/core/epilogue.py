"""A loaded artifact's epilogue: the program's ``global`` tail as one ONNX Runtime session.

Terms:
    epilogue: what runs once per call after the stages, on the flat inputs and the stages'
        full-length outputs (a DiT's unpatchify that the capture could not follow token by
        token, a pooling); ``plan.json["tail"]`` names its file, the flat inputs it reads
        (``null`` for a non-tensor input baked in), its leaf inputs and its output count.

Imports no torch (:mod:`tppc.artifact.core`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tppc.backends.onnxruntime import session_options
from tppc.errors import ArtifactError

__all__ = ["OrtTail", "check_tail"]


class OrtTail:
    """The epilogue's session (see the module docstring)."""

    def __init__(self, entry: dict[str, Any], root: Path, threads: int,
                 providers: Sequence[Any] | None = None) -> None:
        self.entry = entry
        self.session = ort.InferenceSession(str(root / entry["file"]), session_options(threads),
                                            providers=list(providers or
                                                           ["CPUExecutionProvider"]))

    def __call__(self, flat: Sequence[Any], leaves: Sequence[Any]) -> list[np.ndarray]:
        """The model's flat outputs from the flat inputs and the stages' full outputs."""
        feeds = {name: np.ascontiguousarray(value)
                 for name, value in zip(self.entry["inputs"], flat) if name is not None}
        feeds.update(zip(self.entry["leaves"], (np.ascontiguousarray(v) for v in leaves)))
        return list(self.session.run(None, feeds))


def check_tail(tail: Any, files: dict[str, Any], n_inputs: int, n_leaves: int) -> None:
    """``plan.json["tail"]``: null, or an entry whose file is listed and whose inputs and
    leaves match the signature.

    Raises:
        ArtifactError: naming the field, its value and the fix.
    """
    if tail is None:
        return
    ok = isinstance(tail, dict) and tail.get("file") in files \
        and isinstance(tail.get("files"), list) and all(f in files for f in tail["files"]) \
        and isinstance(tail.get("inputs"), list) and len(tail["inputs"]) == n_inputs \
        and all(n is None or isinstance(n, str) for n in tail["inputs"]) \
        and isinstance(tail.get("leaves"), list) and len(tail["leaves"]) == n_leaves \
        and all(isinstance(n, str) for n in tail["leaves"]) \
        and isinstance(tail.get("outputs"), int) and not isinstance(tail["outputs"], bool) \
        and tail["outputs"] >= 0
    if not ok:
        raise ArtifactError(
            f"plan.json: tail is {str(tail)[:80]}, expected null or {{file (listed in files), "
            f"files, inputs ({n_inputs} names or nulls), leaves ({n_leaves} names), outputs}}. "
            "fix: re-export the artifact (plan.json was edited or is damaged)")
