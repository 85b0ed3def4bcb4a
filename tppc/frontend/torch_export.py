"""torch.export with a symbolic sequence length, specialisation checks and readable errors."""

from __future__ import annotations

import inspect
import re
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc.errors import CaptureError
from tppc.frontend.block_capture import block_shapes, export_blocks
from tppc.frontend.export_errors import explain, size_ints_reason
from tppc.frontend.exported_programs import (
    functional,
    refuse_weight_writes,
    register_dataclasses,
)
from tppc.frontend.guard_sites import describe_site, guard_sites, loop_over_positions
from tppc.frontend.isolation import isolated
from tppc.frontend.joint_inputs import JointInput
from tppc.frontend.length_bounds import admitted_range, bound_site
from tppc.frontend.length_ropes import stateless_length_ropes
from tppc.frontend.recurrence_refusals import loop_refusal
from tppc.frontend.reroll_capture import export_rerolled
from tppc.frontend.sample_tables import fit_sample_tables
from tppc.frontend.size_ints import UnitInt, export_size_ints, find_unit_int, read_from_tokens
from tppc.ir.context import CompileContext

__all__ = ["example_units", "export_dynamic", "is_latent"]

_DEFAULT_MAX_FACTOR = 64


def export_dynamic(
    model: torch.nn.Module,
    bound: inspect.BoundArguments,
    axes: dict[str, tuple[int, ...]],
    patch: int,
    *,
    max_seq: int | None,
    joint: JointInput | None = None,
) -> tuple[fx.GraphModule, CompileContext]:
    """Export with one shared ``Dim`` on every sequence axis; check it was not specialised.

    ``joint``: an input over the joint ``[context | tokens]`` sequence, whose axis is
    exported as ``per_unit · Dim + rest`` (:mod:`tppc.frontend.joint_inputs`).

    Returns the unlifted, runnable GraphModule (parameters as ``get_attr``) and a context
    whose ``specialization`` is set when torch.export fixed the sequence size.
    """
    units = example_units(bound, axes, patch)
    upper = max_seq or max(units * _DEFAULT_MAX_FACTOR, 4096)
    dim = torch.export.Dim("seq", min=2, max=max(upper, units + 1))
    shapes = _dynamic_shapes(bound, axes, dim, patch)
    if joint is not None:
        shapes[joint.name] = {joint.axis: dim * joint.per_unit + joint.rest
                              if joint.per_unit > 1 else dim + joint.rest}
    unit = _unit_int(bound, axes, patch)
    tokens = unit is None and _token_stream(bound, axes)  # refused early: no chunk runs them
    length_bound = None
    try:
        with guard_sites(stop=tokens) as log:
            ep, pinned = _export(model, bound, shapes), None
    except CaptureError:
        raise
    except Exception as exc:  # torch raises many types; we name the construct
        site = describe_site(log.sites)
        if tokens and log.block is not None:  # stopped at (or failed on) padding to blocks
            shapes = block_shapes(bound, axes, log.block, units, upper,
                                  lambda name, v, d: _spec_for(name, v, axes, d, patch))
            return export_blocks(model, log, lambda: _export(model, bound, shapes).module(),
                                 exc, (axes, units), (_drop_guards, _seq_symbol),
                                 lambda loop, k, first=exc: _export_rerolled(
                                     model, bound, axes, units, loop, first, k))
        loop = next((s for s in (describe_site([f]) for f in log.sites)
                     if s is not None and loop_over_positions(s[1])), None)
        if tokens and loop is not None:  # pinned before it too (RecurrentGemma's reset gate
            return _export_rerolled(model, bound, axes, units, loop, exc)  # on position_ids)
        if not re.search(_PINNED, str(exc)):
            raise CaptureError(explain(model, exc)) from exc
        span = admitted_range(exc, units) if joint is None else None
        within = _export_within(model, bound, axes, patch, units, span) if span else None
        if within is not None:  # a branch on the length: capture the example's side of it
            (ep, (lo, hi)), pinned = within, None
            length_bound = (lo, hi, bound_site(log.range_sites, hi))
        elif unit is not None:  # sizes as Python ints: tie the unit int to the tokens
            return _export_with_unit_int(model, bound, shapes, axes, unit, exc)
        else:
            try:  # the model pins the size: keep the shapes symbolic, run at the example only
                ep = _export(model, bound, shapes, deferred=True)
            except Exception:
                if site is not None and loop_over_positions(site[1]):
                    raise CaptureError(loop_refusal(model, site, exc, "re-rolling needs a "
                                                    "token stream")) from exc
                why = f" at {site[0]} (`{site[1]}`)" if site is not None else ""
                raise CaptureError(explain(model, exc, why + size_ints_reason(bound))) from exc
            line = f"at {site[0]}: `{site[1]}`" if site is not None else _pinned_line(exc)
            pinned = f"torch.export: {str(exc).strip().splitlines()[0]} ({line})"
    gm = ep.module()
    guard = pinned or _check_guards(gm, bound, axes, patch, units)
    if guard is not None and pinned is None:  # guarded to the example: keep shapes symbolic
        try:
            gm = _export(model, bound, shapes, deferred=True).module()
        except Exception as exc:  # EasyAnimate: torch's runtime-assert pass, a TraceError
            raise CaptureError(
                f"torch.export guarded {type(model).__name__} to the example's size ({guard}), "
                "and exporting it again with the sizes symbolic failed inside torch.export's "
                f"own runtime-assert pass ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                "tppc cannot capture a length that both pins and stays symbolic here. fix: "
                "run the model at this size unsplit (eager or torch.compile), or report it "
                "with the model's config") from exc
    guards = getattr(gm, "_guards_fn", None) if guard is None else None
    _drop_guards(gm)
    symbol = _seq_symbol(gm, axes)
    if symbol is None:
        guard = guard or "the sequence axis became a constant"
        symbol = sympy.Symbol("s", positive=True, integer=True)
    ctx = CompileContext(
        seq_symbol=symbol,
        example_seq=units,
        seq_inputs=dict(axes),
        capture_mode="dynamic",
        specialization=guard,
        input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        shape_guards=guards,
        length_bound=length_bound,
    )
    return gm, ctx


def _export_rerolled(model: torch.nn.Module, bound: inspect.BoundArguments,
                     axes: dict[str, tuple[int, ...]], units: int, site: tuple[str, str],
                     exc: Exception, unit: int = 1) -> tuple[fx.GraphModule, CompileContext]:
    """The re-rolled capture of a loop over positions (:mod:`.reroll_capture`; ``unit``: the
    tokens of a block the model pads to), or the loop's refusal with the re-roller's reason."""
    def export(inputs: inspect.BoundArguments) -> fx.GraphModule:
        gm = _export(model, inputs, None).module()
        _drop_guards(gm)
        return gm

    try:
        gm, block = export_rerolled(bound, axes, (units, unit), export, site[0])
    except CaptureError:  # the model refused for another reason than its loop
        raise
    except Exception as again:  # RerollError, or torch.export failing at a fixed length
        raise CaptureError(loop_refusal(model, site, exc, again)) from exc
    symbol = _seq_symbol(gm, axes)
    if symbol is None:
        raise CaptureError(loop_refusal(model, site, exc, "the re-rolled graph's length is a "
                                        "constant"))
    ctx = CompileContext(
        seq_symbol=symbol, example_seq=units // block, seq_inputs=dict(axes),
        capture_mode="dynamic",
        input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        rerolled=site[0], block_size=block if block > 1 else None)
    return gm, ctx


def _export_within(model: torch.nn.Module, bound: inspect.BoundArguments,
                   axes: dict[str, tuple[int, ...]], patch: int, units: int,
                   span: tuple[int, int]
                   ) -> tuple[torch.export.ExportedProgram, tuple[int, int]] | None:
    """torch.export with the sequence ``Dim`` in ``span`` (:mod:`.length_bounds`; narrowed
    again while torch suggests a narrower range that still holds the example) and the range
    it held, or None when that fails (the caller then names the first failure)."""
    for _ in range(3):
        dim = torch.export.Dim("seq", min=span[0], max=span[1])
        try:
            return _export(model, bound, _dynamic_shapes(bound, axes, dim, patch)), span
        except Exception as exc:
            narrower = admitted_range(exc, units, low=span[0], high=span[1])
            if narrower is None or narrower == span:
                return None
            span = narrower
    return None


def _token_stream(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the first sequence input is a token stream (ids or embeddings), not a latent."""
    name = next(iter(axes), None)
    value = bound.arguments.get(name) if name is not None else None
    return isinstance(value, torch.Tensor) and not is_latent(value, axes[name])


def _unit_int(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
              patch: int) -> UnitInt | None:
    """The size int that counts the token stream's units (:mod:`.size_ints`), or None (the
    first sequence input is a latent, or no integer inputs multiply to its tokens)."""
    name = next(iter(axes), None)
    value = bound.arguments.get(name) if name is not None else None
    if not isinstance(value, torch.Tensor) or is_latent(value, axes[name]):
        return None
    return find_unit_int(bound, int(value.shape[axes[name][0]]))


def _export_with_unit_int(model: torch.nn.Module, bound: inspect.BoundArguments,
                          shapes: dict[str, Any], axes: dict[str, tuple[int, ...]],
                          unit: UnitInt, pinned: Exception
                          ) -> tuple[fx.GraphModule, CompileContext]:
    """Capture with ``unit`` and the token axes as one ``Dim`` of units (:mod:`.size_ints`):
    a ``dynamic`` capture whose symbol counts the unit int; its other ints stay constant."""
    # torch.export takes no named Dim for an int: both are AUTO and it finds tokens = c * int
    token_axes = {name: dict.fromkeys(dims, torch.export.Dim.AUTO) for name, dims in axes.items()}

    def export(spec: dict[str, Any]) -> fx.GraphModule:
        try:
            return _export(model, bound, spec).module()
        except Exception:  # a guard on the units: defer it, the shape guards keep it
            return _export(model, bound, spec, deferred=True).module()

    try:
        gm = export_size_ints(export, shapes, bound, unit, token_axes)
    except Exception as exc:
        raise CaptureError(explain(model, pinned, size_ints_reason(bound) + f" (tying {unit.label}"
                                    f" to the tokens failed too: {str(exc).splitlines()[0]})")
                           ) from exc
    guards = getattr(gm, "_guards_fn", None)
    _drop_guards(gm)
    unit = read_from_tokens(gm, unit, token_axes)
    symbol = _seq_symbol(gm, axes)
    if symbol is None:
        raise CaptureError(explain(model, pinned, size_ints_reason(bound)))
    ctx = CompileContext(
        seq_symbol=symbol, example_seq=unit.value, seq_inputs=dict(axes),
        capture_mode="dynamic", input_names=tuple(n.name for n in gm.graph.nodes
                                                  if n.op == "placeholder"),
        shape_guards=guards, size_int=unit)
    return gm, ctx


def _export(model: torch.nn.Module, bound: inspect.BoundArguments, shapes: dict[str, Any],
            *, deferred: bool = False) -> torch.export.ExportedProgram:
    """torch.export; ``deferred`` turns size guards into runtime asserts instead of failing.

    One export at a time in the process; it traces a shadow of ``model``'s module tree, so
    other threads see ``model``'s own tensors meanwhile, and ``model`` is left as it was (see
    :mod:`tppc.frontend.isolation`), whether the export succeeded or raised.
    """
    with isolated(model) as traced:
        traced.register_forward_hook(lambda _module, _inputs, out: register_dataclasses(out))
        fit_sample_tables(traced, bound)
        stateless_length_ropes(traced)
        ep = torch.export.export(traced, bound.args, bound.kwargs, dynamic_shapes=shapes,
                                 strict=False,
                                 prefer_deferred_runtime_asserts_over_guards=deferred)
        ep = functional(ep)
        refuse_weight_writes(ep, type(model).__name__)
        return ep


_PINNED = r"Constraints violated|specialized it to be a constant"


def _pinned_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if "specialized" in ln]
    return lines[0].lstrip("- ") if lines else "the model code fixed it"


def example_units(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                  patch: int) -> int:
    """The example's sequence length in units (tokens, or patch rows of a latent)."""
    sizes: dict[str, int] = {}
    for name, dims in axes.items():
        t = bound.arguments[name]
        for d in dims:
            size = int(t.shape[d])
            if is_latent(t, dims):
                if size % patch:
                    raise CaptureError(
                        f"input {name!r} axis {d} has size {size}, not a multiple of the patch "
                        f"size {patch}; fix: pad the latent to a multiple of {patch}"
                    )
                size //= patch
            sizes[f"{name}[{d}]"] = size
    if len(set(sizes.values())) != 1:
        raise CaptureError(
            f"sequence axes disagree in length: {sizes}; every sequence axis must have the "
            "same length. fix: pass seq_dims= naming only the axes that grow with the sequence"
        )
    units = next(iter(sizes.values()))
    if units < 2:
        raise CaptureError(
            f"the example sequence has length {units}; torch.export specialises lengths 0 and "
            "1. fix: capture with an example of at least 2 tokens"
        )
    return units


def is_latent(t: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``t`` is a latent whose height (in patch rows) is the sequence axis.

    Image latents ``(b, c, h, w)`` (axis 2) or video latents ``(b, f, c, h, w)`` /
    ``(b, c, f, h, w)`` (axis 3); the width is the last axis in both.
    """
    return t.is_floating_point() and dims == (t.dim() - 2,) and t.dim() in (4, 5)


def _dynamic_shapes(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                    dim: Any, patch: int) -> dict[str, Any]:
    shapes: dict[str, Any] = {}
    sig = bound.signature
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            shapes[name] = {k: _spec_for(k, v, axes, dim, patch) for k, v in value.items()}
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            shapes[name] = tuple(None for _ in value)
        else:
            shapes[name] = _spec_for(name, value, axes, dim, patch)
    return shapes


def _spec_for(name: str, value: Any, axes: dict[str, tuple[int, ...]], dim: Any,
              patch: int) -> Any:
    if not isinstance(value, torch.Tensor):
        return pytree.tree_map(lambda _: None, value) if isinstance(value, list | tuple | dict) \
            else None
    if name not in axes:
        return None
    if is_latent(value, axes[name]):
        return {value.dim() - 2: patch * dim if patch > 1 else dim}
    return dict.fromkeys(axes[name], dim)


def _check_guards(gm: fx.GraphModule, bound: inspect.BoundArguments,
                  axes: dict[str, tuple[int, ...]], patch: int, units: int) -> str | None:
    """Run the export's input guards on meta inputs one sequence unit longer."""
    guards = getattr(gm, "_guards_fn", None)
    if guards is None:
        return None

    def grow(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or name not in axes:
            return value
        shape = list(value.shape)
        step = patch if is_latent(value, axes[name]) else 1
        for d in axes[name]:
            shape[d] += step
        return torch.empty(shape, dtype=value.dtype, device="meta")

    args = tuple(grow(n, v) for n, v in zip(bound.signature.parameters, bound.args))
    kwargs = {k: grow(k, v) for k, v in bound.kwargs.items()}
    flat, _ = pytree.tree_flatten((args, kwargs))
    try:
        guards(*flat)
    except Exception as exc:
        return f"{exc} (at a sequence length of {units + 1} instead of {units})"
    return None


def _drop_guards(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.recompile()


def _seq_symbol(gm: fx.GraphModule, axes: dict[str, tuple[int, ...]]) -> sympy.Symbol | None:
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in axes:
            continue
        val = node.meta.get("val")
        for d in axes[node.name]:
            size = val.shape[d]
            if isinstance(size, torch.SymInt):
                free = sorted(size.node.expr.free_symbols, key=str)
                if free:
                    return free[0]
    return None
