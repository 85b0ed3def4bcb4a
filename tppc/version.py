"""The tppc version (written into artifacts; ``tppc.__version__``). Imports nothing."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
