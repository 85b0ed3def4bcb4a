"""The captured side of a pipeline: graphs of one batch shape, and binding call inputs to them.

Terms:
    front end: the annotated graph, the chunk-step graph and the compile context of one
        capture (:class:`FrontEnd`). Captured graphs fix every axis but the sequence axes,
        so a call with another batch size is captured again (cached per batch shape).
    batch shape: the sizes of every tensor input with its sequence axes left out; calls
        that differ from a front end's only on axis 0 (the batch) get their own front end,
        and so do calls with other keyword inputs (``generate`` adds ``position_ids`` to a
        model compiled with ``attention_mask``).
    input structure: which inputs a call passes and the dtype of each tensor among them
        (:func:`input_structure`); a call with another structure gets its own front end
        (a float timestep into a model compiled with an integer one: captured again for
        that dtype, as ``torch.compile`` recompiles).
    planning front end: a front end made only to be priced (``tppc.plan``): a model whose
        blocks are all the same computation is captured with two of them and its layer list
        re-expanded (:mod:`tppc.frontend.blocks`), so an 80-layer model plans in seconds. Its
        chunk graph holds fewer blocks than ``ctx.layers`` lists: it is never emitted.

``tppc.plan``, ``tppc.compile`` and the distributed compile all start here
(:func:`capture_front_end`), then plan with :func:`tppc.driver.planning.length_planner`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc.errors import CaptureError, RuntimeInputError
from tppc.frontend.annotate import annotate
from tppc.frontend.block_capture import check_block_length
from tppc.frontend.blocks import expand_layers, few_blocks
from tppc.frontend.capture import bind_inputs
from tppc.frontend.isolation import CAPTURE_LOCK, shadow_tree
from tppc.ir.context import CompileContext
from tppc.ir.records import CHUNK_SIGNATURE, TOKEN
from tppc.passes.chunking.chunk_attention import ChunkSignature, chunk_attention_pass
from tppc.passes.runner import run_passes
from tppc.program.patches import rows_per_unit

__all__ = ["BoundCall", "CallInputs", "FrontEnd", "batch_shape", "bind", "capture_front_end",
           "check_finite", "guards_hold", "input_structure", "on_meta_if", "read_inputs"]

BatchShape = tuple[tuple[int | None, ...] | None, ...]


@dataclass(frozen=True)
class FrontEnd:
    """One capture of the model (see the module docstring).

    Attributes:
        annotated: the annotated, grouped graph (what the cost model prices).
        chunk: the chunk-step graph.
        ctx: its compile context.
        signature: the chunk step's signature.
        batch: its batch shape.
        bidirectional: names of its bidirectional attention and buffered-mixing nodes
            (linear attention, "same" convolutions; their calls run as one chunk: exact, see
            DESIGN.md "Token semantics").
        seconds: wall time of the capture (capture, annotation, grouping, chunk rewrite).
        truncated: ``(module path, real block count)`` of a planning front end (see the
            module docstring), None for a front end that may be emitted.
        passes: the records of the capture in ``ctx.history`` (its first ``passes``; each
            emission appends its own after them).
    """

    annotated: fx.GraphModule
    chunk: fx.GraphModule
    ctx: CompileContext
    signature: ChunkSignature
    batch: BatchShape
    bidirectional: tuple[str, ...]
    seconds: float = 0.0
    truncated: tuple[str, int] | None = None
    passes: int = 0

    @functools.cached_property
    def key(self) -> tuple[str, BatchShape]:
        """Cache key: the input structure (:func:`input_structure`) and the batch shape."""
        values = [ph.meta.get("val") for ph in self.placeholders]
        return (input_structure(self.signature.in_spec, values), self.batch)

    def serves(self, structure: str, bound: BoundCall) -> bool:
        """Whether a call of input ``structure`` bound as ``bound`` runs on this capture: its
        batch shape (a ``specialized`` capture's resolution included) is this one's."""
        names = [p.name for p in self.placeholders]
        return (self.key[0] == structure and batch_shape(bound.flat, self.ctx, names)
                == self.batch and guards_hold(self.ctx, bound.flat))

    @functools.cached_property
    def placeholders(self) -> tuple[fx.Node, ...]:
        """The captured graph's user inputs, in flat order."""
        return tuple(self.annotated.graph.find_nodes(op="placeholder"))

    @functools.cached_property
    def unit_rows(self) -> tuple[tuple[int, str, int, int], ...]:
        """``(flat index, input, axis, positions per unit)`` of each sequence axis whose unit
        spans several positions (a latent's height in patch rows of 2)."""
        return tuple((i, ph.name, axis, rows) for i, ph in enumerate(self.placeholders)
                     for axis in self.ctx.seq_inputs.get(ph.name, ())
                     if (rows := rows_per_unit(ph.meta["val"].shape[axis])) > 1)


@dataclass(frozen=True)
class BoundCall:
    """Call inputs bound to a front end: flat inputs, sequence length, batch shape."""

    flat: list[Any]
    length: int
    batch: BatchShape


def capture_front_end(model: torch.nn.Module, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any] | None, *,
                      seq_dims: Mapping[str, int | tuple[int, ...]] | None,
                      plan_only: bool = False) -> FrontEnd:
    """Capture, annotate, group and chunk ``model`` for inputs shaped like ``args``.

    Inputs move to the meta device when the model's parameters are there (a model built
    without weights). ``plan_only``: a planning front end (see the module docstring), made
    when the blocks are identical (:func:`tppc.frontend.blocks.few_blocks` checks).
    """
    t0 = time.perf_counter()
    args, kwargs = on_meta_if(model, (tuple(args), dict(kwargs or {})))
    if not plan_only:
        return _front_end(model, args, kwargs, seq_dims, t0)
    # the block list is shortened in a shadow of the module tree (same tensors), never in the
    # user's model: an eager call from another thread meanwhile runs every block
    shadow = shadow_tree(model)
    with CAPTURE_LOCK, few_blocks(shadow) as truncated:
        front = _front_end(shadow, args, kwargs, seq_dims, t0)
    if truncated is None:
        return front
    layers = expand_layers(front.ctx.layers, *truncated)
    if sum(layer.kind == "block" for layer in layers) != truncated[1]:
        # the blocks group_layers found are not the list we shortened: capture it all
        return _front_end(model, args, kwargs, seq_dims, t0)
    front.ctx.layers = layers
    return dataclasses.replace(front, truncated=truncated,
                               seconds=time.perf_counter() - t0)


def _front_end(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               seq_dims: Mapping[str, int | tuple[int, ...]] | None, t0: float) -> FrontEnd:
    annotated, ctx = annotate(model, args, kwargs, seq_dims=seq_dims)
    chunk = run_passes(annotated, ctx, [chunk_attention_pass])
    flat = _flat(model, args, kwargs)
    bidirectional = tuple(n.name for n in annotated.graph.nodes
                          if n.meta.get(TOKEN) is not None
                          and n.meta[TOKEN].attention == "bidirectional")
    names = [p.name for p in annotated.graph.find_nodes(op="placeholder")]
    ctx.captured_passes = len(ctx.history)
    return FrontEnd(annotated=annotated, chunk=chunk, ctx=ctx,
                    signature=chunk.meta[CHUNK_SIGNATURE], batch=batch_shape(flat, ctx, names),
                    bidirectional=bidirectional, passes=len(ctx.history),
                    seconds=time.perf_counter() - t0)


def on_meta_if(model: torch.nn.Module, tree: Any) -> Any:
    """``tree``'s tensors on the meta device when ``model``'s parameters are there."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        return tree
    return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, tree)


def batch_shape(flat: list[Any], ctx: CompileContext, names: list[str]) -> BatchShape:
    """The sizes of each flat tensor input without its sequence axes (None: not a tensor).

    A ``specialized`` capture runs at its resolution only, so its sequence axes are kept:
    a call at another resolution (or width, or batch) has another batch shape and gets its
    own capture, never a refusal. Integer inputs are part of it (torch.export keeps them
    constant; a new value is captured again), except the one the sequence symbol counts
    (``ctx.size_int``, :mod:`tppc.frontend.size_ints`).
    """
    out: list[tuple[int | None, ...] | None] = []
    unit = getattr(ctx.size_int, "placeholder", None)
    for name, value in zip(names, flat):
        if not isinstance(value, torch.Tensor):  # another int: another capture
            out.append((value,) if _is_int(value) and name != unit else None)
            continue
        seq = () if ctx.capture_mode == "specialized" else \
            ctx.seq_inputs.get(name, ()) + ctx.joint_inputs.get(name, ())[:1]
        out.append(tuple(None if i in seq else int(s) for i, s in enumerate(value.shape)))
    return tuple(out)


@dataclass(frozen=True)
class CallInputs:
    """A call's inputs bound to ``model.forward`` once: flat, their tree spec and structure."""

    flat: list[Any]
    spec: pytree.TreeSpec
    structure: str
    """The input structure as :attr:`FrontEnd.key` spells it (:func:`input_structure`)."""


def input_structure(spec: Any, flat: list[Any]) -> str:
    """Which inputs a call passes (the tree ``spec``) and each tensor's dtype, as one string."""
    dtypes = ",".join(str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor)
                      else "-" for v in flat)
    return f"{spec!r} dtypes=({dtypes})"


def read_inputs(model: torch.nn.Module, args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> CallInputs:
    """Bind ``args``/``kwargs`` to ``model.forward`` and flatten them, once per call.

    Raises:
        RuntimeInputError: inputs ``model.forward`` does not take.
    """
    flat, spec = pytree.tree_flatten(_bound(model, args, kwargs))
    return CallInputs(flat=flat, spec=spec, structure=input_structure(spec, flat))


def bind(front: FrontEnd, model: torch.nn.Module, inputs: CallInputs) -> BoundCall:
    """Check call inputs (:func:`read_inputs`) against ``front``: their structure, dtypes and
    ranks. Static sizes (batch, a latent's width, a table's length) may differ: the call's
    :func:`batch_shape` then selects (or captures) another front end.

    Raises:
        RuntimeInputError: naming the input, what it is (on the meta device, NaN, an empty
            batch), what was compiled, and the fix.
    """
    flat, spec = inputs.flat, inputs.spec
    signature = front.signature
    if signature.in_spec is not None and spec != signature.in_spec:
        raise RuntimeInputError(
            f"inputs of {type(model).__name__} have structure {spec}, the pipeline was "
            f"compiled for {signature.in_spec}. fix: pass the inputs used at compile time")
    lengths = {}
    placeholders = front.placeholders
    for ph, value in zip(placeholders, flat):
        seq = front.ctx.seq_inputs.get(ph.name, ())
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise RuntimeInputError(
                f"input {ph.name!r} is on the meta device (shape {tuple(value.shape)}): it "
                "has a shape but no data to run (tppc.plan takes meta inputs, a call does "
                "not). fix: pass real tensors, e.g. on cpu (the pipeline moves inputs to "
                "its stages)")
        check_input(ph, value, skip_axes=_static_axes(ph, seq))
        check_finite(ph.name, value)
        if 0 not in seq and isinstance(value, torch.Tensor) and value.dim() \
                and value.shape[0] == 0:
            raise RuntimeInputError(
                f"input {ph.name!r} has batch size 0 (shape {tuple(value.shape)}): there is "
                "nothing to run. fix: pass at least one sequence (batch size ≥ 1)")
        for axis in seq:
            if front.ctx.block_size is not None:  # captured as k × blocks
                check_block_length(ph.name, front.ctx.block_size, int(value.shape[axis]),
                                   front.ctx.model_name)
            lengths[ph.name] = int(value.shape[axis]) // rows_per_unit(ph.meta["val"].shape[axis])
    if len(set(lengths.values())) != 1:
        raise RuntimeInputError(f"sequence inputs disagree in length: {lengths}. fix: give "
                                "every sequence input the same number of tokens")
    length = next(iter(lengths.values()))
    names = [p.name for p in placeholders]
    batch = batch_shape(flat, front.ctx, names)
    own = front.ctx.size_int is None or batch == front.batch  # else: another grid's units
    if length < 1 and own:
        raise RuntimeInputError("the sequence has 0 tokens. fix: pass at least one token")
    if own:  # else another capture serves the call (its own grid)
        _check_unit_int(front, placeholders, flat, length)
    _check_joint(front, placeholders, flat, length)
    return BoundCall(flat=flat, length=length, batch=batch)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_unit_int(front: FrontEnd, placeholders: tuple[fx.Node, ...], flat: list[Any],
                    length: int) -> None:
    """Refuse a call whose unit int (``ctx.size_int``) is not its tokens' units: the graph
    reads it from the tokens, the model would read the int."""
    unit = front.ctx.size_int
    if unit is None:
        return
    value = next((v for ph, v in zip(placeholders, flat) if ph.name == unit.placeholder), None)
    if value != length:
        tokens = length * unit.per_unit
        raise RuntimeInputError(
            f"input {unit.label} is {value!r}, but the {tokens} tokens of the call make "
            f"{length} units of {unit.per_unit} tokens (compiled with {unit.grid}). fix: pass "
            f"{unit.label}={length}, or "
            f"{value * unit.per_unit if _is_int(value) else 'n'} tokens for the grid you pass (the product of the grid's ints is the token count)")


def _check_joint(front: FrontEnd, placeholders: tuple[fx.Node, ...], flat: list[Any],
                 length: int) -> None:
    """Refuse a call whose joint input (``ctx.joint_inputs``: Chroma's text + image mask) is
    not as long as its context plus the call's tokens: the graph reads it by those rows."""
    for ph, value in zip(placeholders, flat):
        joint = front.ctx.joint_inputs.get(ph.name)
        if joint is None or not isinstance(value, torch.Tensor) or value.dim() <= joint[0]:
            continue
        axis, rest = joint
        tokens = length * front.ctx.tokens_per_unit()
        if int(value.shape[axis]) != rest + tokens:
            raise RuntimeInputError(
                f"input {ph.name!r} axis {axis} has {int(value.shape[axis])} entries, but it "
                f"spans the joint sequence: {rest} context positions (compiled) + the call's "
                f"{tokens} tokens = {rest + tokens}. fix: pass it over the {rest} context "
                f"positions and the {tokens} tokens (a new context length is a new compile)")


def guards_hold(ctx: CompileContext, flat: list[Any]) -> bool:
    """Whether the capture's shape guards (``ctx.shape_guards``) accept the flat inputs'
    shapes: a size where the model's Python took another branch than at the example (PixArt
    at its ``sample_size`` reads its stored table, elsewhere it computes one) fails them."""
    if ctx.shape_guards is None:
        return True
    metas = [torch.empty(v.shape, dtype=v.dtype, device="meta")
             if isinstance(v, torch.Tensor) else v for v in flat]
    try:
        ctx.shape_guards(*metas)
    except Exception:  # torch raises AssertionError or RuntimeError naming the guard
        return False
    return True


def _static_axes(ph: fx.Node, seq: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of an input that are not sequence axes (a new size there is a new capture)."""
    val = ph.meta.get("val")
    rank = val.dim() if isinstance(val, torch.Tensor) else 0
    return tuple(axis for axis in range(rank) if axis not in seq)


def check_finite(name: str, value: Any) -> None:
    """Refuse a floating input holding NaN: results would depend on the attention kernel.

    Eager masked attention multiplies masked probabilities (0) by value rows, so one NaN
    reaches every position (0 x NaN = NaN); a chunk never reads later chunks' rows, so the
    pipeline keeps earlier positions finite. Neither pattern is meaningful: refuse by name.
    Infinities pass (an additive mask holds -inf).

    Raises:
        RuntimeInputError: naming the input and the first NaN's index.
    """
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return
    bad = value.isnan()
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise RuntimeInputError(
            f"input {name!r} holds NaN (first at index {where}, {int(bad.sum())} in all): "
            "masked attention spreads a NaN differently in eager and in chunks, so no "
            "result would be meaningful. fix: replace NaN before the call (e.g. "
            "torch.nan_to_num) or find where it came from")




def _bound(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    try:
        bound = bind_inputs(model, tuple(args), dict(kwargs))
    except CaptureError as exc:
        raise RuntimeInputError(str(exc)) from exc
    return (bound.args, bound.kwargs)


def _flat(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
          ) -> list[Any]:
    return pytree.tree_flatten(_bound(model, args, kwargs))[0]


def check_input(ph: fx.Node, value: Any, *, skip_axes: tuple[int, ...] = ()) -> None:
    """Check one flat input against its captured placeholder (type, dtype, rank, sizes).

    ``skip_axes``: static axes not checked (the batch axis, which is re-captured).

    Raises:
        RuntimeInputError: naming the input, what it is, what was compiled, and the fix.
    """
    val = ph.meta.get("val")
    if not isinstance(val, torch.Tensor):
        if _is_int(val) and _is_int(value):  # another batch shape: captured again
            return
        if val is not None and value != val:
            raise RuntimeInputError(f"input {ph.name!r} is {value!r}, compiled with {val!r}. "
                                    f"fix: pass {ph.name}={val!r}")
        return
    if not isinstance(value, torch.Tensor):
        raise RuntimeInputError(f"input {ph.name!r} must be a tensor, got {type(value).__name__}")
    if value.dtype != val.dtype or value.dim() != val.dim():
        raise RuntimeInputError(
            f"input {ph.name!r} is {value.dtype} of rank {value.dim()}, compiled for "
            f"{val.dtype} of rank {val.dim()}. fix: pass a {val.dtype} tensor of rank "
            f"{val.dim()}")
    for axis, (got, want) in enumerate(zip(value.shape, val.shape)):
        if axis not in skip_axes and not isinstance(want, torch.SymInt) and got != int(want):
            raise RuntimeInputError(
                f"input {ph.name!r} has size {got} on axis {axis} (shape "
                f"{tuple(value.shape)}), compiled for {int(want)}. fix: pass inputs of the "
                f"compiled shape (only the batch and the sequence axes may change)")
