"""Capture by ``torch.fx.symbolic_trace`` when torch.export cannot take the model.

Terms:
    probe run: one run of the traced graph on real inputs whose sequence axes were grown by
        k units (k = 0, 1, 2: the example itself and two longer copies of it), recording the
        shape and dtype of every node's output and every integer it computes.
    fit: each size seen at the probe lengths u, u + 1, u + 2 written as ``a*s + b`` of a fresh
        sympy symbol ``s``; a size that is not such a function of the sequence length (it
        grows by different steps) is refused with a ``CaptureError`` naming the node.

The traced graph holds torch-level calls (``call_function``), tensor methods
(``call_method``) and torch.nn leaf modules (``call_module``). Its ``meta["val"]`` holds a
:class:`~tppc.passes._shapes.ShapeVal` per tensor (sympy sizes, dtype) instead of a fake
tensor, and a sympy expression per integer (``x.size(1)`` is ``s``), so the passes see the
same symbolic shapes torch.export would give. No fake tensors run: modules that call numpy
or ``torch.fx.wrap``-ed helpers are fine, as long as they run at the probe lengths.

Example:
    >>> gm, ctx = trace_fx(model, bound, {"ids": (1,)}, 1, export_error=msg)  # doctest: +SKIP
    >>> ctx.capture_mode, tensor_val(next(iter(gm.graph.nodes))).shape
    ('fx', (1, s))
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import sympy
import torch
from torch import fx

from tppc._export import example_units, is_latent
from tppc.context import CompileContext
from tppc.errors import CaptureError
from tppc.passes._shapes import ShapeVal, module_path

__all__ = ["trace_fx"]

_PROBES = (0, 1, 2)
"""Units added to the example's sequence length in the probe runs."""


class _Seen(NamedTuple):
    """A tensor output of one probe run, without its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def trace_fx(
    model: torch.nn.Module,
    bound: inspect.BoundArguments,
    axes: dict[str, tuple[int, ...]],
    patch: int,
    *,
    export_error: str,
) -> tuple[fx.GraphModule, CompileContext]:
    """Trace ``model`` with symbolic_trace and give its nodes symbolic shapes from probe runs.

    Args:
        model: the module torch.export refused.
        bound: its example inputs bound to ``forward``'s signature.
        axes: input name -> sequence axes.
        patch: patch size of image latents (1 otherwise).
        export_error: torch.export's explanation, repeated if this fallback fails too.

    Returns:
        The runnable GraphModule (``meta["val"]`` on every node) and a context with
        ``capture_mode == "fx"``.

    Raises:
        CaptureError: symbolic_trace failed, a probe run failed, or a size is not linear.
    """
    units = example_units(bound, axes, patch)
    inputs = _inputs(bound)
    gm = _trace(model, inputs, export_error)
    lengths = [units + k for k in _PROBES]
    name = type(model).__name__
    runs = [_probe(gm, _grown(inputs, axes, patch, k), units, k, name) for k in _PROBES]
    sym = sympy.Symbol("s", positive=True, integer=True)
    for node in gm.graph.nodes:
        samples = [run[node.name] for run in runs]
        node.meta["val"] = _fit(node, samples, lengths, sym)
    ctx = CompileContext(
        seq_symbol=sym,
        example_seq=units,
        seq_inputs=dict(axes),
        capture_mode="fx",
        input_names=tuple(str(n.target) for n in gm.graph.nodes
                          if n.op == "placeholder" and not str(n.target).startswith("*")),
    )
    return gm, ctx


def _inputs(bound: inspect.BoundArguments) -> dict[str, Any]:
    """Every parameter of ``forward`` with its example value (defaults filled in)."""
    values: dict[str, Any] = {}
    for name, param in bound.signature.parameters.items():
        value = bound.arguments.get(name, param.default)
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if value not in ((), {}, inspect.Parameter.empty):
                raise CaptureError(
                    f"the torch.fx.symbolic_trace fallback cannot pass *{name} inputs "
                    f"({value!r}); fix: pass them as named arguments of forward"
                )
            continue
        values[name] = value
    return values


def _trace(model: torch.nn.Module, inputs: dict[str, Any], export_error: str) -> fx.GraphModule:
    concrete = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    try:
        gm = fx.symbolic_trace(model, concrete_args=concrete)
    except Exception as exc:
        raise CaptureError(
            f"{export_error}\nThe torch.fx.symbolic_trace fallback failed too: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    _default_to_concrete(gm, model, concrete)
    return gm


def _default_to_concrete(gm: fx.GraphModule, model: torch.nn.Module,
                         concrete: dict[str, Any]) -> None:
    """Give the graph's concrete inputs their own names and traced values as defaults.

    symbolic_trace renames them (``use_cache_1``) and keeps the signature's default, so
    ``gm(*args)`` would trip its own specialisation assert; after this it runs like the model.
    """
    params = list(inspect.signature(model.forward).parameters)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(params) != len(phs):
        return  # pytree-flattened inputs: leave the graph as traced
    for node, name in zip(phs, params):
        value = concrete.get(name, ...)
        if value is None or isinstance(value, bool | int | float | str):
            node.target = name
            node.args = (value,)
    gm.recompile()


def _grown(inputs: dict[str, Any], axes: dict[str, tuple[int, ...]], patch: int,
           extra: int) -> dict[str, Any]:
    """The tensor inputs with ``extra`` units appended on each sequence axis (copied values)."""
    out = {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        for d in axes.get(name, ()):
            step = patch if is_latent(value, axes[name]) else 1
            size = value.shape[d] + extra * step
            reps = -(-size // value.shape[d])
            value = torch.cat([value] * reps, dim=d).narrow(d, 0, size)
        out[name] = value
    return out


class _Recorder(fx.Interpreter):
    """Runs the graph on given inputs and keeps a data-free summary of each node's output."""

    def __init__(self, gm: fx.GraphModule, inputs: dict[str, Any]) -> None:
        super().__init__(gm)
        self.inputs = inputs
        self.seen: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        """Run ``n`` (placeholders take ``inputs`` by name) and record its output's summary."""
        if n.op != "placeholder":
            result = super().run_node(n)
        elif n.target in self.inputs:
            result = self.inputs[str(n.target)]
        elif str(n.target).startswith("*"):
            result = {} if str(n.target).startswith("**") else ()
        elif n.args:
            result = n.args[0]  # a concrete (non-tensor) input: its traced value
        else:
            raise CaptureError(f"the traced graph's input {n.target!r} has no example value")
        self.seen[n.name] = _summary(result)
        return result


def _probe(gm: fx.GraphModule, tensors: dict[str, Any], units: int, extra: int,
           model_name: str) -> dict[str, Any]:
    recorder = _Recorder(gm, tensors)
    try:
        with torch.no_grad():
            recorder.run(enable_io_processing=False)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"the torch.fx.symbolic_trace capture of {model_name} failed to run at sequence "
            f"length {units + extra} (the example has {units}), which tppc needs to find the "
            f"symbolic shapes: {type(exc).__name__}: {_first_line(exc)}. fix: let the model "
            "accept longer sequences (e.g. position tables longer than the example), or "
            "capture with a shorter example"
        ) from exc
    return recorder.seen


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Seen(tuple(value.shape), value.dtype, value.device)
    if isinstance(value, list | tuple):
        return tuple(_summary(v) for v in value)
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    return value


def _fit(node: fx.Node, samples: list[Any], lengths: list[int], sym: sympy.Symbol) -> Any:
    """One symbolic value from the probe runs' summaries of a node's output."""
    first = samples[0]
    if isinstance(first, _Seen):
        _same(node, samples, lambda s: isinstance(s, _Seen) and
              (len(s.shape), s.dtype) == (len(first.shape), first.dtype), "rank or dtype")
        shape = tuple(_linear(node, [s.shape[i] for s in samples], lengths, sym,
                              f"axis {i} sizes") for i in range(len(first.shape)))
        return ShapeVal(shape, first.dtype, first.device)
    if isinstance(first, int) and not isinstance(first, bool):
        _same(node, samples, lambda s: type(s) is type(first), "type")
        return _linear(node, samples, lengths, sym, "values")
    if isinstance(first, tuple):
        _same(node, samples, lambda s: isinstance(s, tuple) and len(s) == len(first), "length")
        return tuple(_fit(node, [s[i] for s in samples], lengths, sym) for i in range(len(first)))
    if isinstance(first, dict):
        _same(node, samples, lambda s: isinstance(s, dict) and s.keys() == first.keys(), "keys")
        return {k: _fit(node, [s[k] for s in samples], lengths, sym) for k in first}
    return first  # a constant (float, bool, None, dtype...): its value at the example length


def _same(node: fx.Node, samples: list[Any], ok: Any, what: str) -> None:
    if not all(ok(s) for s in samples):
        raise CaptureError(
            f"node {node.name!r} ({_describe(node)}) changes its {what} with the sequence "
            f"length ({samples}); tppc needs values whose structure does not depend on it"
        )


def _linear(node: fx.Node, values: list[int], lengths: list[int], sym: sympy.Symbol,
            what: str) -> sympy.Expr:
    """``values`` (seen at ``lengths``, one unit apart) as ``a*sym + b``, or a CaptureError."""
    a = values[1] - values[0]
    b = values[0] - a * lengths[0]
    if any(v != a * n + b for v, n in zip(values, lengths)):
        raise CaptureError(
            f"node {node.name!r} ({_describe(node)}) has {what} {values} at sequence lengths "
            f"{lengths}: not a linear function a*s + b of the sequence length s, so the fx "
            "capture cannot give it a symbolic size. fix: keep sizes linear in the sequence "
            "length (no reshape that squares or divides it), or make the model exportable by "
            "torch.export"
        )
    return sympy.Integer(a) * sym + sympy.Integer(b)


def _describe(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", node.target)
    return f"{node.op} {target}, module {module_path(node) or '<top level>'}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
