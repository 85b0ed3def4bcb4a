"""The captures of one compiled model, and binding a call's inputs to one of them.

Terms:
    capture: a :class:`tppc.frontend.front_end.FrontEnd`: the model captured for one input
        structure (which keyword inputs, each tensor's dtype) and one batch shape. A call
        whose inputs another capture serves runs there; a new batch shape, new keyword
        inputs or new dtypes are captured on the call, once for concurrent callers, and
        cached (least recently used first out, ``CompileOptions.program_cache``).
    bind: a call's inputs bound to ``model.forward`` once (:func:`read_inputs`), checked
        against a capture (:func:`tppc.frontend.front_end.bind`).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.utils._pytree as pytree

from tppc.errors import CaptureError, RuntimeInputError
from tppc.frontend.capture import bind_inputs
from tppc.frontend.front_end import (
    BoundCall,
    CallInputs,
    FrontEnd,
    bind,
    capture_front_end,
    read_inputs,
)
from tppc.frontend.shape_check import fake_forward, refusal_text
from tppc.frontend.size_ints import check_grid
from tppc.ir.context import CompileContext

__all__ = ["RUN_KEYWORDS", "Captures", "check_length_limit", "forward_parameters"]

_ANY_BATCH = object()
"""First item of a capture key that matches any batch shape of an input structure."""


class Captures:
    """The captures of one model (module docstring); thread-safe.

    Args:
        model: the compiled model.
        front: the example's capture.
        seq_dims: the sequence axes given to compile.
        keep: captures kept at most.
        max_seq: the longest sequence a call may have (None: no limit).
    """

    def __init__(self, model: torch.nn.Module, front: FrontEnd, *,
                 seq_dims: Mapping[str, int | tuple[int, ...]] | None, keep: int,
                 max_seq: int | None) -> None:
        self.model, self.seq_dims, self.keep, self.max_seq = model, seq_dims, keep, max_seq
        self.example = front
        self._fronts: OrderedDict[Any, FrontEnd] = OrderedDict({front.key: front})
        self._pending: dict[Any, Future[FrontEnd]] = {}  # captures in flight, by key
        self._lock = threading.Lock()
        self._partial: OrderedDict[Any, str] = OrderedDict()  # checked sizes: refusal or ""

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]:
        """The capture for these inputs (captured for a new batch size) and the bound call.

        Raises:
            RuntimeInputError: naming the input, what it is, what was compiled, and the fix.
        """
        inputs = read_inputs(self.model, args, kwargs)  # bound once per call
        structure = inputs.structure
        base = self._front_for((_ANY_BATCH, structure),  # other inputs or dtypes: capture
                               lambda: self._capture_inputs(args, kwargs, inputs))
        bound = bind(base, self.model, inputs)
        self._check_partial_units(base, inputs)
        tokens = bound.length * (base.ctx.block_size or 1)  # a block capture's unit: k tokens
        if self.max_seq is not None and tokens > self.max_seq:
            raise RuntimeInputError(
                f"the sequence has {tokens} tokens, max_seq={self.max_seq}. "
                f"fix: compile with max_seq={tokens} (or more), or max_seq=None")
        check_length_limit(base.ctx, bound.length, "the sequence")
        with self._lock:  # a dynamic capture serves many sizes, a specialised one its own
            front = next((f for f in reversed(self._fronts.values())
                          if f.serves(structure, bound)), None)
        front = front or self._front_for((structure, bound.batch),
                                         lambda: self._capture(args, kwargs, bound))
        if front is not base and front.ctx.size_int is not None:  # units of its own grid
            bound = bind(front, self.model, inputs)
        return front, dataclasses.replace(bound, batch=front.batch)

    def share(self, other: Captures) -> None:
        """Take ``other``'s captures of other batch shapes (captures are immutable)."""
        with other._lock:
            theirs = list(other._fronts.items())
        with self._lock:
            self._fronts.update((k, f) for k, f in theirs if k != self.example.key)

    def _front_for(self, key: tuple[Any, Any], capture: Callable[[], FrontEnd]) -> FrontEnd:
        """The cached capture for ``key`` (``(_ANY_BATCH, structure)``: the latest of any
        batch shape), else ``capture()``'s, run once for concurrent callers: the first
        captures (the process runs one capture at a time, :mod:`tppc.frontend.isolation`),
        the others wait for it and share its capture or its error."""
        with self._lock:
            front = (self._fronts.get(key) if key[0] is not _ANY_BATCH else
                     next((f for f in reversed(self._fronts.values()) if f.key[0] == key[1]),
                          None))
            if front is not None:
                if key[0] is not _ANY_BATCH:
                    self._fronts.move_to_end(key)
                return front
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            front = capture()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._fronts[front.key] = front
            while len(self._fronts) > self.keep:
                self._fronts.popitem(last=False)
            del self._pending[key]
        pending.set_result(front)
        return front

    def _capture(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 bound: BoundCall | None) -> FrontEnd:
        if bound is not None and bound.length < 2 and self.example.ctx.size_int is None:
            raise RuntimeInputError(
                f"a call with batch shape {bound.batch} needs a new capture, and a "
                f"{bound.length}-token call cannot be captured. fix: call once with at least "
                "2 tokens at this batch size")
        what = f"inputs {sorted(kwargs)}" if bound is None else f"batch shape {bound.batch}"
        self._check_grid(args, kwargs)
        changed = _changed_axes(self.example, bound)
        if changed:  # before any capture: does the model itself take these sizes?
            refusal, _ = fake_forward(self.model, tuple(args), dict(kwargs))
            if refusal is not None:
                name = type(self.model).__name__
                raise RuntimeInputError(
                    f"{changed[:-2]}: {name} itself fails at these sizes "
                    f"({refusal_text(refusal)}), "
                    f"so no capture was tried. fix: pass the sizes {name} was compiled with "
                    "on those axes, or sizes its forward takes") from refusal
        try:
            return capture_front_end(self.model, tuple(args), kwargs, seq_dims=self.seq_dims)
        except CaptureError as exc:
            raise RuntimeInputError(f"{changed}re-capturing {type(self.model).__name__} for "
                                    f"{what} failed: {exc}") from exc

    def _check_partial_units(self, front: FrontEnd, inputs: CallInputs) -> None:
        """Refuse by name a call whose sequence axis is no whole number of units (a latent's
        height the patch size does not divide) when the model itself fails at that size, or
        returns another shape than at the whole units tppc runs (a fake forward of each,
        :mod:`tppc.frontend.shape_check`, once per call shape); else the call runs its whole
        units, as the model does (a strided patch embedding drops the partial row too). A
        grid of size ints has its own checks (its units may be another capture's)."""
        if front.ctx.size_int is not None:
            return
        flat = inputs.flat
        partial = [(i, name, axis, int(flat[i].shape[axis]), rows)
                   for i, name, axis, rows in front.unit_rows
                   if isinstance(flat[i], torch.Tensor) and int(flat[i].shape[axis]) % rows]
        if not partial:
            return
        key = (inputs.structure, tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else repr(v)
                                       for v in inputs.flat))
        with self._lock:
            said = self._partial.get(key)
        if said is None:
            said = _partial_refusal(self.model, inputs, partial)
            with self._lock:
                self._partial[key] = said
                while len(self._partial) > 64:
                    self._partial.popitem(last=False)
        if said:
            raise RuntimeInputError(said)

    def _check_grid(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse by name a call whose size ints do not make its tokens (a model that
        reads its token grid from Python ints, :mod:`tppc.frontend.size_ints`)."""
        unit = self.example.ctx.size_int
        if unit is None:
            return
        name, axes = next(iter(self.example.ctx.seq_inputs.items()))
        try:
            check_grid(unit, bind_inputs(self.model, tuple(args), dict(kwargs)), name, axes[0])
        except ValueError as exc:
            raise RuntimeInputError(str(exc)) from None

    def _capture_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                        inputs: CallInputs) -> FrontEnd:
        """A capture for a new input structure: other inputs, or other dtypes of the same
        inputs; a failure names the dtype that differs, or the keyword no parameter takes."""
        try:
            return self._capture(args, kwargs, None)
        except RuntimeInputError as exc:
            cause = str(exc.__cause__ or exc).splitlines()[0]
            name = type(self.model).__name__
            with self._lock:
                same = next((f for f in self._fronts.values()
                             if f.signature.in_spec == inputs.spec), None)
            if same is not None:  # only dtypes differ: the compiled dtype, named
                try:
                    bind(same, self.model, inputs)
                except RuntimeInputError as refusal:
                    raise RuntimeInputError(f"{refusal} (captured again for these dtypes, "
                                            f"{name} failed: {cause})") from exc
            unnamed = sorted(set(kwargs) - forward_parameters(self.model))
            if unnamed:  # keywords only a **kwargs takes
                raise RuntimeInputError(
                    f"keyword {', '.join(map(repr, unnamed))} is not a parameter of {name}."
                    f"forward (its **kwargs takes it), and re-capturing {name} with it failed."
                    f" fix: drop {unnamed[0]}= from the call (tppc's own per-call keywords "
                    f"are {list(RUN_KEYWORDS)}). torch.export's error: {cause}") from exc
            raise


def _partial_refusal(model: torch.nn.Module, inputs: CallInputs,
                     partial: list[tuple[int, str, int, int, int]]) -> str:
    """The refusal of a call with partial units (:meth:`Captures._check_partial_units`), or
    ``""`` when the model runs it as its whole units."""
    _, name, axis, size, rows = partial[0]
    where = (f"input {name!r} axis {axis} is {size}, not a whole number of its units of "
             f"{rows} (compiled as {rows}·n)")
    fix = (f"fix: pass a multiple of {rows} on axis {axis} of {name!r} "
           f"({size - size % rows} or {size - size % rows + rows})")
    model_name = type(model).__name__
    args, kwargs = pytree.tree_unflatten(inputs.flat, inputs.spec)
    refusal, out = fake_forward(model, args, kwargs)
    if refusal is None and out is None:  # the fake forward cannot tell: run the whole units
        return ""
    whole = list(inputs.flat)
    for i, _, ax, n, r in partial:
        whole[i] = whole[i].narrow(ax, 0, n - n % r)
    failed, floored = fake_forward(model, *pytree.tree_unflatten(whole, inputs.spec))
    if failed is not None:  # whole units fail too: another size is wrong, named at capture
        return ""
    if refusal is not None:
        return f"{where}: {model_name} itself fails at {size} ({refusal_text(refusal)}). {fix}"
    if floored is None or _shapes(floored) == _shapes(out):
        return ""
    return (f"{where}: {model_name} takes {size} and returns shapes {_shapes(out)}, where its "
            f"whole units ({size - size % rows}) give {_shapes(floored)}, and tppc runs whole "
            f"units only. {fix}")


def _shapes(tree: Any) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in pytree.tree_leaves(tree) if isinstance(v, torch.Tensor)]


def _changed_axes(example: FrontEnd, bound: BoundCall | None) -> str:
    """``"input 'x' axis 1 is 3, compiled with 4; "``: the static sizes in which a call's
    batch shape differs from the example's (a wrong channel count, hidden size or width
    reads so before torch.export's error), or ``""``."""
    if bound is None or len(bound.batch) != len(example.batch):
        return ""
    names = [p.name for p in example.placeholders]
    said = [f"input {name!r} axis {axis} is {new}, compiled with {old}"
            for name, was, now in zip(names, example.batch, bound.batch, strict=False)
            if was is not None and now is not None and len(was) == len(now)
            for axis, (old, new) in enumerate(zip(was, now, strict=True))
            if old is not None and new is not None and old != new]
    return "; ".join(said) + ("; " if said else "")


RUN_KEYWORDS = ("timeout", "executor", "trace")
"""Keywords of a call that are the compiled pipeline's own (``CompiledPipeline.run``'s)
unless ``model.forward`` names them."""


def forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    """The parameters ``model.forward`` names (not those a ``**kwargs`` would take)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature: every keyword is the model's
        return frozenset(RUN_KEYWORDS)
    return frozenset(n for n, p in params.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def check_length_limit(ctx: CompileContext, units: int, what: str) -> None:
    """Refuse ``units`` beyond the longest length the model runs at (``ctx.length_limit``)
    or outside the lengths the capture holds (``ctx.length_bound``: the model's Python takes
    another branch there, which torch.export did not trace; XGLM's table grown in forward
    is even traced wrong, so no second capture is tried).

    Raises:
        RuntimeInputError: naming the length, the limit, why, and the fix.
    """
    if ctx.length_bound is not None and not ctx.length_bound[0] <= units <= ctx.length_bound[1]:
        lo, hi, where = ctx.length_bound
        raise RuntimeInputError(
            f"{what} has {units} tokens; {ctx.model_name or 'the model'} was captured for "
            f"{lo} to {hi} tokens: torch.export bounded the length at {where} (a Python "
            f"branch on the length, or a table sliced by it) and traced the example's side "
            f"only. fix: pass {lo} to {hi} tokens")
    if ctx.length_limit is not None and units > ctx.length_limit[0]:
        limit, why = ctx.length_limit
        raise RuntimeInputError(
            f"{what} has {units} tokens; {ctx.model_name or 'the model'} runs at no more than "
            f"{limit}: {why}. fix: pass at most {limit} tokens (eager fails there too)")
