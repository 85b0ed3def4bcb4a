"""torch.export of a component at fixed shapes (a text encoder, a VAE decoder).

The transformer is captured with a symbolic sequence length (:mod:`.capture`); the
components around it run whole, once per pipeline call, at the shapes of that call, so they
are exported as they are: no dynamic dimension, no annotation. The model may live on the
meta device (inputs are moved there), and it is left as it was (:mod:`.isolation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc.errors import CaptureError
from tppc.frontend.exported_programs import register_dataclasses
from tppc.frontend.isolation import CAPTURE_LOCK, isolated

__all__ = ["MethodCall", "export_static", "outside_inference"]


class MethodCall(torch.nn.Module):
    """``module.<method>(*args, **kwargs)`` as a module's forward, first output only when
    the method returns a tuple or a diffusers output (``vae.decode(z).sample``)."""

    def __init__(self, module: torch.nn.Module, method: str) -> None:
        super().__init__()
        self.inner = module
        self.method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self.inner, self.method)(*args, **kwargs)
        if isinstance(out, tuple):
            return out[0]
        if hasattr(out, "to_tuple"):  # a diffusers / transformers ModelOutput
            return out.to_tuple()[0]
        return out


def export_static(model: torch.nn.Module, args: tuple[Any, ...],
                  kwargs: Mapping[str, Any] | None = None, *, method: str = "forward"
                  ) -> fx.GraphModule:
    """Export ``model.<method>`` at the example's shapes; weights become ``get_attr`` nodes.

    Raises:
        CaptureError: torch.export refused the component (its error is quoted).
    """
    module = model if method == "forward" else MethodCall(model, method)
    args, kwargs = outside_inference((tuple(args), dict(kwargs or {})))
    if _on_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                            (tuple(args), kwargs))
    name = f"{type(model).__name__}.{method}"
    with CAPTURE_LOCK, isolated(module) as traced:
        traced.register_forward_hook(lambda _module, _inputs, out: register_dataclasses(out))
        try:
            ep = torch.export.export(traced, tuple(args), kwargs, strict=False)
        except Exception as exc:  # torch raises many types; name the component
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CaptureError(
                f"{name}: torch.export could not capture it at the example's shapes ({first}); "
                "check that the example inputs are what the pipeline passes, or price this "
                "component by hand") from exc
    return ep.module()


def outside_inference(tree: Any) -> Any:
    """``tree`` with every inference-mode tensor copied to a normal one: torch.export traces
    with autograd on and refuses an input made under ``torch.inference_mode()``."""
    def plain(t: torch.Tensor) -> torch.Tensor:
        if not t.is_inference():
            return t
        with torch.inference_mode(False):
            return t.clone()

    return pytree.tree_map_only(torch.Tensor, plain, tree)


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())
