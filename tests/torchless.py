"""A fresh interpreter where ``import torch`` fails: what a machine without torch runs.

Shared by the tests that load an exported artifact without torch (``tppc.load``, the
ONNX Runtime runner): one stub that refuses every ``torch`` import, and one check that the
snippet imported none.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

__all__ = ["NO_TORCH", "run_without_torch"]

NO_TORCH = textwrap.dedent("""
    import builtins, sys
    real = builtins.__import__
    def no_torch(name, *a, **k):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
        return real(name, *a, **k)
    builtins.__import__ = no_torch
""")
"""Python that makes every later ``import torch...`` raise ImportError."""


def run_without_torch(code: str, timeout: float = 300) -> str:
    """Run ``code`` (dedented) in a new interpreter after :data:`NO_TORCH`, then check that
    no ``torch`` module was imported; returns its stdout.

    Fails the calling test with the tail of its stderr when the snippet fails.
    """
    script = NO_TORCH + textwrap.dedent(code) + (
        '\nassert "torch" not in sys.modules, '
        'sorted(m for m in sys.modules if "torch" in m)\n')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
