"""The ``tppc`` command line (``main``) and the torchrun rank entry (``rank``)."""

from __future__ import annotations

from tppc.cli.main import main

__all__ = ["main"]
