"""Captures that run one at a time and leave nothing behind in the user's model.

Terms:
    capture lock: one process-wide lock every torch.export in tppc holds (:data:`CAPTURE_LOCK`).
        torch.export is not re-entrant: two exports at once swap fake tensors into each
        other's modules and restore each other's process flags (``torch.backends.mkldnn``).
    module state: for every submodule of the model, its attribute dictionary (training flag,
        parameters, buffers, child modules, hooks, plain attributes such as HF rotary
        embeddings' ``long_inv_freq``), the contents of the dicts, lists and sets in it, and
        the value of every tensor it holds. A capture runs the model's ``forward`` on fake
        tensors, and a ``forward`` that initialises state lazily (``self.x = ...`` on the
        first call) would otherwise leave a FakeTensor in the model.
    shadow tree: a copy of the model's module tree (:func:`shadow_tree`): every submodule a
        new object of the same class with its own attribute dictionary and containers,
        holding the model's own parameter and buffer tensors (no weight is copied).
        torch.export (non-strict) swaps the parameters and buffers of the module it traces
        for FakeTensors until it returns; it traces the shadow, so the user's model keeps
        its real tensors throughout, and other threads may read or run it meanwhile (a
        FakeTensor read by another thread reports the device ``meta`` while the export runs
        a kernel: a capture in that thread moved its inputs to ``meta`` and emitted
        ``arange(device="meta")``, whose embedding lookup read garbage).

:func:`isolated` holds the lock, yields the shadow tree to export, and restores a
:class:`ModuleSnapshot` of the model afterwards, whether the capture succeeded or raised:
every attribute is the same object again, with the same value (buffers and plain tensor
attributes are copied; parameters, which a capture never writes, are checked by their version
counter instead, so no weight is copied).

Example:
    >>> with isolated(model) as traced:           # doctest: +SKIP
    ...     ep = torch.export.export(traced, args)
    >>> model.rotary_emb.__dict__.get("long_inv_freq")   # None: the fake one is gone
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tppc.errors import CaptureError

__all__ = ["CAPTURE_LOCK", "ModuleSnapshot", "isolated", "shadow_tree"]

CAPTURE_LOCK = threading.RLock()
"""Held by every capture in the process (re-entrant: a capture may hold it across strategies)."""

_CONTAINERS = (dict, OrderedDict, list, set)
"""Container types whose contents a snapshot keeps (exact types: subclasses may not copy)."""


@dataclass(frozen=True)
class _TensorState:
    """One tensor of the model: its fingerprint before the capture and (not for parameters)
    a copy of its value."""

    name: str
    tensor: torch.Tensor
    fingerprint: tuple[Any, ...] | None
    copy: torch.Tensor | None


@dataclass(frozen=True)
class ModuleSnapshot:
    """The state of a module tree (see the module docstring), taken before a capture.

    Attributes:
        attributes: per submodule, a shallow copy of its ``__dict__``.
        contents: per submodule, shallow copies of the dicts, lists and sets in it
            (``_parameters``, ``_buffers``, ``_modules``, hooks, the user's own caches).
        tensors: every parameter, buffer and plain tensor attribute, once each.
    """

    attributes: tuple[tuple[torch.nn.Module, dict[str, Any]], ...]
    contents: tuple[tuple[Any, Any], ...]
    tensors: tuple[_TensorState, ...]

    @classmethod
    def take(cls, model: torch.nn.Module) -> ModuleSnapshot:
        """Snapshot ``model`` and all its submodules."""
        attributes, contents, tensors = [], [], {}
        for path, module in model.named_modules(remove_duplicate=True):
            attrs = dict(module.__dict__)
            attributes.append((module, attrs))
            contents.extend((v, type(v)(v)) for v in attrs.values()
                            if type(v) in _CONTAINERS)
            prefix = f"{path}." if path else ""
            for name, t in _tensors_of(attrs):
                if id(t) not in tensors:
                    keep = not isinstance(t, torch.nn.Parameter)
                    tensors[id(t)] = _TensorState(f"{prefix}{name}", t, _fingerprint(t),
                                                  _copy(t) if keep else None)
        return cls(tuple(attributes), tuple(contents), tuple(tensors.values()))

    def restore(self) -> None:
        """Put every attribute, container and tensor value back as it was when taken.

        Raises:
            CaptureError: a parameter was written in place (its value cannot be restored
                without a copy of the weights, which tppc does not keep).
        """
        for module, attrs in self.attributes:
            current = module.__dict__
            for key in [k for k in current if k not in attrs]:
                del current[key]
            for key, value in attrs.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        for container, saved in self.contents:
            _refill(container, saved)
        changed = [s for s in self.tensors if _fingerprint(s.tensor) != s.fingerprint
                   or s.fingerprint is None]
        for state in changed:
            if state.copy is not None:
                _put_back(state.tensor, state.copy)
        written = [s.name for s in changed if s.copy is None and s.fingerprint is not None]
        if written:
            raise CaptureError(
                f"capturing the model wrote its parameter(s) {written[:5]} in place; tppc "
                "restores buffers and attributes but keeps no copy of the weights. fix: do not "
                "write parameters in forward (keep such state in a buffer)")


_MISSING = object()


@contextmanager
def isolated(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Hold the capture lock, yield ``model``'s shadow tree (the module to trace), and
    restore ``model``'s state on exit (success or error)."""
    with CAPTURE_LOCK:
        snapshot = ModuleSnapshot.take(model)
        try:
            yield shadow_tree(model)
        finally:
            snapshot.restore()


def shadow_tree(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree that shares its tensors (see the module docstring).

    Shared submodules stay shared, a plain attribute or bound method that refers to a module
    of the tree refers to its copy, and tied weights stay tied (the same tensor objects).

    Example:
        >>> shadow = shadow_tree(model)                       # doctest: +SKIP
        >>> shadow.lm_head is model.lm_head, shadow.lm_head.weight is model.lm_head.weight
        (False, True)
    """
    copies: dict[int, torch.nn.Module] = {}
    for module in model.modules(remove_duplicate=True):
        copy = object.__new__(type(module))
        copy.__dict__.update({k: type(v)(v) if type(v) in _CONTAINERS else v
                              for k, v in module.__dict__.items()})
        copies[id(module)] = copy
    for copy in copies.values():
        attrs = copy.__dict__
        for key, value in list(attrs.items()):
            attrs[key] = _in_tree(value, copies)
        modules = attrs.get("_modules")
        if modules:
            for key, child in list(modules.items()):
                modules[key] = _in_tree(child, copies)
    return copies[id(model)]


def _in_tree(value: Any, copies: dict[int, torch.nn.Module]) -> Any:
    """``value`` with a module of the tree (or a method bound to one) replaced by its copy."""
    if isinstance(value, torch.nn.Module):
        return copies.get(id(value), value)
    if isinstance(value, types.MethodType) and id(value.__self__) in copies:
        return types.MethodType(value.__func__, copies[id(value.__self__)])
    return value


def _tensors_of(attrs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, buffers and plain tensor attributes of one module's ``__dict__``."""
    for key in ("_parameters", "_buffers"):
        for name, t in attrs.get(key, {}).items():
            if isinstance(t, torch.Tensor):
                yield name, t
    for name, value in attrs.items():
        if isinstance(value, torch.Tensor):
            yield name, value


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What an in-place write or a swap of the data changes (None: not readable)."""
    try:
        version = None if t.is_inference() else t._version
        where = 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()
        return (version, tuple(t.shape), t.stride(), t.dtype, t.device, where,
                t.storage_offset())
    except (RuntimeError, NotImplementedError):
        return None


def _copy(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.detach().clone()


def _put_back(t: torch.Tensor, saved: torch.Tensor) -> None:
    """Write ``saved`` into ``t`` (same object afterwards, same value as before)."""
    mode = torch.inference_mode() if t.is_inference() else torch.no_grad()
    with mode:
        if _fingerprint(t) is not None and t.shape == saved.shape and t.dtype == saved.dtype:
            t.copy_(saved)
        else:
            t.data = saved


def _refill(container: Any, saved: Any) -> None:
    """Restore a dict, list or set's contents in place (order included)."""
    if isinstance(container, dict):
        same = list(container) == list(saved) and all(
            container[k] is v for k, v in saved.items())
        if not same:
            container.clear()
            container.update(saved)
    elif isinstance(container, list):
        container[:] = saved
    else:
        container.clear()
        container.update(saved)
