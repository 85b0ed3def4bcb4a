"""Load ``MODULE:FACTORY`` specs: a function returning ``(model, args[, kwargs])``."""

from __future__ import annotations

import importlib
from typing import Any

from tppc.errors import TppcError

__all__ = ["load_factory"]


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Import ``MODULE:FACTORY`` and call it; returns ``(model, args, kwargs)``."""
    if ":" not in spec:
        raise TppcError(
            f"{spec!r} is not MODULE:FACTORY; fix: e.g. tppc.examples:gpt or mypkg.models:make"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TppcError(f"cannot import module {module_name!r} of {spec!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise TppcError(f"{module_name} has no callable {attr!r}; callables there: {names}")
    result = factory()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TppcError(
            f"{spec} returned {type(result).__name__}; it must return (model, args) or "
            "(model, args, kwargs)"
        )
    model, args, *rest = result
    return model, tuple(args), dict(rest[0]) if rest else {}
