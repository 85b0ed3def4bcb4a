"""Shim: ``python -m tppc.run`` (and ``torchrun ... -m tppc.run``) runs :mod:`tppc.cli.rank`."""

from __future__ import annotations

import sys

from tppc.cli.rank import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
