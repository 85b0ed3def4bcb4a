"""A compiled pipeline as a drop-in for its model: :class:`ModelStandIn`.

A drop-in for the model (as ``torch.compile``'s wrapper is): a public attribute the pipeline
does not have is the model's (``cp.config``, ``cp.dtype``, ``cp.device``: what a diffusers
pipeline reads of ``pipe.transformer = tppc.compile(pipe.transformer, ...)``).
It also answers ``__class__`` and ``__module__`` as the model's (``isinstance(cp, type(model))``;
``type(cp)`` stays :class:`tppc.pipeline.compiled.CompiledPipeline`): diffusers registers a
pipeline component by them and saves it by its class, so ``pipe.save_pretrained`` after that
assignment saves the model's weights and config and the saved pipeline loads back as a plain
diffusers pipeline. ``to``, ``half`` and their kin reach the model where they change nothing,
and are refused where they would convert its weights (:mod:`tppc.pipeline.conversions`).

The pipeline sets ``_model`` (and its instance's ``__module__``) when it is built.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from tppc.pipeline.conversions import check_conversion

__all__ = ["ModelStandIn"]


class ModelStandIn:
    """What a compiled pipeline answers as its model (module docstring); ``_model``: the model."""

    _model: torch.nn.Module

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The model's class (module docstring)."""
        model = self.__dict__.get("_model")
        return type(self) if model is None else type(model)

    def __getattr__(self, name: str) -> Any:
        """A public attribute of the model (module docstring), else AttributeError."""
        model = self.__dict__.get("_model")
        if name.startswith("_") or model is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(f"neither the compiled pipeline nor its model "
                                 f"{type(model).__name__} has an attribute {name!r}") from None

    def to(self, *args: Any, **kwargs: Any) -> Self:
        """``model.to(...)`` where it changes nothing; a conversion of the weights is
        refused (:mod:`tppc.pipeline.conversions`)."""
        return self._convert("to", args, kwargs)

    def half(self) -> Self:
        """As :meth:`to`."""
        return self._convert("half", (), {})

    def float(self) -> Self:
        """As :meth:`to`."""
        return self._convert("float", (), {})

    def double(self) -> Self:
        """As :meth:`to`."""
        return self._convert("double", (), {})

    def bfloat16(self) -> Self:
        """As :meth:`to`."""
        return self._convert("bfloat16", (), {})

    def cpu(self) -> Self:
        """As :meth:`to`."""
        return self._convert("cpu", (), {})

    def cuda(self, *args: Any, **kwargs: Any) -> Self:
        """As :meth:`to`."""
        return self._convert("cuda", args, kwargs)

    def _convert(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Self:
        check_conversion(self._model, method, args, kwargs)
        getattr(self._model, method)(*args, **kwargs)
        return self
