"""``tppc run DIR --input in.npz --output out.npz``: run an artifact from the shell (no torch).

The input ``.npz`` holds one array per model input, named as in ``plan.json``'s signature;
it is read with ``allow_pickle=False``. The output ``.npz`` holds the model's flat outputs,
named by their path in the output structure (``logits``, ``0``, ``0.1``...).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from tppc.artifact.core.load import load
from tppc.errors import RuntimeInputError

__all__ = ["flat_outputs", "run_artifact"]


def run_artifact(artifact: str, inputs: str, output: str, *, threads: int | None = None,
                 generate: int = 0, expected_sha256: str | None = None) -> int:
    """Load ``artifact`` (refused unless its ``plan.json`` has the digest
    ``expected_sha256``, when given), run it on the arrays of ``inputs``, write ``output``;
    exit code."""
    runner = load(artifact, threads_per_stage=threads, expected_sha256=expected_sha256)
    try:
        with np.load(inputs, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise RuntimeInputError(f"cannot read {inputs} as an .npz of arrays ({exc}). fix: "
                                "save the inputs with numpy.savez") from exc
    t0 = time.perf_counter()
    if generate:
        names = list(arrays)
        if len(names) != 1:
            raise RuntimeInputError(f"--generate takes one input (token ids), got {names}")
        result: dict[str, Any] = {"ids": runner.generate(arrays[names[0]], generate)}
    else:
        result = flat_outputs(runner(**arrays))
    workers = f" ({len(runner.stages)} workers)" if runner.stage_of else ""
    stages = len(set(runner.stage_of)) if runner.stage_of else len(runner.stages)
    print(f"ran {stages} stage(s){workers} in {time.perf_counter() - t0:.3f} s",
          file=sys.stderr)
    np.savez(output, **result)
    return 0


def flat_outputs(value: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Arrays of an output structure by their path (``logits``, ``0``, ``1.key``)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix or "output": np.asarray(value)}
    out: dict[str, np.ndarray] = {}
    for key, item in items:
        out.update(flat_outputs(item, f"{prefix}.{key}" if prefix else str(key)))
    return out
