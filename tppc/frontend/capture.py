"""Capture a model as an fx graph whose shapes carry the sequence length as a sympy symbol.

Terms:
    sequence axis: the axis of an input that grows with the sequence (``input_ids`` axis 1;
        a DiT latent's height, whose patch rows become the token axis).
    sequence symbol: the sympy symbol torch.export gives that axis (``s70``), shared by
        every sequence axis.

Strategies (``ctx.capture_mode`` records the one that worked):
    ``dynamic``: torch.export with one ``Dim`` on every sequence axis (latents: height only,
        so a band of patch rows is a whole number of tokens).
    ``specialized``: torch.export guarded the sequence size to its example value (PixArt's
        positional table branches on the size, diffusers' DiT computes its patch grid with
        ``sqrt``); exported again with the guards deferred, so the graph's shapes are still
        symbolic and annotation and costing work, and sizes the model's Python computed
        from the example stay literal in the graph (annotation makes such a reshape
        ``global``). The graph itself only runs at the example length, and
        ``ctx.specialization`` says why. A compiled pipeline captures again per resolution
        (:func:`tppc.frontend.front_end.batch_shape` keys it). Height and width are never
        tied to one symbol: a square latent's ``s**2`` tokens make a band of patch rows no
        whole number of tokens per unit of ``s``, and a video's frames-into-batch reshape
        then has two token axes.

When torch.export fails, the :class:`CaptureError` carries tppc's diagnosis (the construct,
the user frame, the fix) on top of torch.export's error in full.

Example:
    >>> gm, ctx = capture(model, (input_ids,))          # doctest: +SKIP
    >>> ctx.seq_symbol, ctx.capture_mode
    (s70, 'dynamic')
"""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from tppc.errors import CaptureError
from tppc.frontend.isolation import CAPTURE_LOCK
from tppc.frontend.joint_inputs import JointInput, follower_input, joint_input
from tppc.frontend.static_export import outside_inference
from tppc.frontend.torch_export import example_units, export_dynamic, is_latent
from tppc.ir.context import CompileContext

__all__ = ["bind_inputs", "capture"]


_MANAGED_KWARGS = {"use_cache": False}
"""Keyword arguments tppc sets itself when the model's forward accepts them."""


def capture(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
    max_seq: int | None = None,
) -> tuple[fx.GraphModule, CompileContext]:
    """Capture ``model`` with a symbolic sequence length.

    Args:
        model: the module to capture (in eval mode). It is left as it was: every parameter,
            buffer and attribute is the same object with the same value afterwards
            (:mod:`tppc.frontend.isolation`); captures in other threads wait for this one.
        args: example positional inputs.
        kwargs: example keyword inputs; ``use_cache`` is set to False by tppc.
        seq_dims: input name -> sequence axis (or axes); found automatically when None.
        max_seq: largest sequence length the graph must accept (default: 64 × the example).

    Returns:
        The captured GraphModule (runnable with the same inputs) and its context.

    Raises:
        CaptureError: naming the construct that failed and what to do.
    """
    with CAPTURE_LOCK:  # one capture at a time in the process, every strategy in one go
        return _capture(model, args, kwargs, seq_dims, max_seq)


def _capture(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
             seq_dims: Mapping[str, int | tuple[int, ...]] | None, max_seq: int | None
             ) -> tuple[fx.GraphModule, CompileContext]:
    start = time.perf_counter()
    args, kwargs = outside_inference((tuple(args), dict(kwargs or {})))
    bound = bind_inputs(model, args, kwargs)
    _check_batch(model, bound)
    axes = _resolve_seq_dims(model, bound, seq_dims)
    patch = _patch_size(model)
    try:
        gm, ctx = export_dynamic(model, bound, axes, patch, max_seq=max_seq)
    except CaptureError as exc:
        name = next(iter(axes), None)
        joint = None if name is None else \
            joint_input(bound, axes, patch, is_latent(bound.arguments[name], axes[name]))
        if joint is None:
            gm, ctx, axes = _capture_follower(model, bound, axes, patch, max_seq, exc)
        else:
            gm, ctx = _capture_joint(model, bound, axes, patch, max_seq, exc, joint)
    if ctx.specialization is not None:  # pinned through a table as long as the rows?
        gm, ctx, axes = _dynamic_with_follower(model, bound, axes, patch, max_seq, gm, ctx)
    ctx.model_name = type(model).__name__
    ctx.capture_seconds = time.perf_counter() - start
    _describe_streams(model, ctx, bound, axes, patch)
    if ctx.specialization is not None:
        ctx.capture_mode = "specialized"
        ctx.specialized_to = {name: tuple(bound.arguments[name].shape) for name in axes}
    return gm, ctx


def _capture_follower(model: torch.nn.Module, bound: inspect.BoundArguments,
                      axes: dict[str, tuple[int, ...]], patch: int, max_seq: int | None,
                      exc: CaptureError
                      ) -> tuple[fx.GraphModule, CompileContext, dict[str, tuple[int, ...]]]:
    """Capture again with a follower input (:func:`follower_input`: a 1-D table as long as
    the patch rows) as one more sequence input; re-raises ``exc`` when there is none, and
    names the input, its axis and the fix when that capture fails too."""
    units = example_units(bound, axes, patch) if axes else 0
    follow = follower_input(bound, axes, units, _CONTEXT_NAME)
    if follow is None:
        raise exc
    name, axis = follow
    try:
        gm, ctx = export_dynamic(model, bound, {**axes, name: (axis,)}, patch, max_seq=max_seq)
    except CaptureError as again:
        raise CaptureError(
            f"{str(exc).partition(chr(10))[0]}\ninput {name!r} axis {axis} has {units} "
            f"entries, as many as the example's sequence units (tokens or patch rows), and "
            f"pins the length; captured as a sequence input it failed too "
            f"({str(again).splitlines()[0]}). fix: build that input inside the model from "
            "the sequence input's size, or pass seq_dims= naming it, or compile per "
            f"resolution.\n{str(exc).partition(chr(10))[2]}") from exc
    return gm, ctx, {**axes, name: (axis,)}


def _dynamic_with_follower(model: torch.nn.Module, bound: inspect.BoundArguments,
                           axes: dict[str, tuple[int, ...]], patch: int, max_seq: int | None,
                           gm: fx.GraphModule, ctx: CompileContext
                           ) -> tuple[fx.GraphModule, CompileContext, dict[str, tuple[int, ...]]]:
    """A specialised capture whose length a follower input pins (:func:`follower_input`: a
    1-D table of row positions) captured again with it as a sequence input; kept only when
    that capture is dynamic, else the specialised one stands."""
    follow = follower_input(bound, axes, example_units(bound, axes, patch), _CONTEXT_NAME)
    if follow is None:
        return gm, ctx, axes
    wider = {**axes, follow[0]: (follow[1],)}
    try:
        gm2, ctx2 = export_dynamic(model, bound, wider, patch, max_seq=max_seq)
    except CaptureError:
        return gm, ctx, axes
    if ctx2.specialization is not None:
        return gm, ctx, axes
    ctx2.follower = (*follow, ctx.specialization)
    return gm2, ctx2, wider


def _capture_joint(model: torch.nn.Module, bound: inspect.BoundArguments,
                   axes: dict[str, tuple[int, ...]], patch: int, max_seq: int | None,
                   exc: CaptureError, joint: JointInput
                   ) -> tuple[fx.GraphModule, CompileContext]:
    """Capture again with ``joint``'s axis as the context's length plus the tokens."""
    try:  # its length as the context's plus the tokens: a derived Dim
        gm, ctx = export_dynamic(model, bound, axes, patch, max_seq=max_seq, joint=joint)
    except CaptureError as again:
        full = str(exc).partition("torch.export's error, in full:\n")[2] or str(exc)
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__} with a symbolic "
            f"length: {joint.describe()}, a tensor over the joint (context + token) "
            "sequence; captured with that axis as the context's length plus the tokens, "
            f"it failed too ({str(again).splitlines()[0]}). fix: call the model without "
            "it where that is exact (a mask of all ones), or run this model eagerly."
            f"\ntorch.export's error, in full:\n{full}") from exc
    ctx.joint_inputs = {joint.name: (joint.axis, joint.rest)}
    return gm, ctx


def _describe_streams(model: torch.nn.Module, ctx: CompileContext, bound: inspect.BoundArguments,
                      axes: dict[str, tuple[int, ...]], patch: int) -> None:
    """Record the patch grid of a latent input and the context-stream inputs on ``ctx``."""
    tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    ctx.context_inputs = tuple(n for n, t in tensors.items()
                               if n not in axes and t.dim() >= 2 and t.numel() > 1)
    ctx.example_values = {n: t.detach() for n, t in tensors.items() if t.device.type != "meta"
                          and (n in ctx.context_inputs or not t.is_floating_point())}
    for name, dims in axes.items():
        t = tensors[name]
        if is_latent(t, dims):
            ctx.patch_size = patch
            rows, cols = int(t.shape[-2]) // patch, int(t.shape[-1]) // patch
            channels = getattr(getattr(model, "config", None), "in_channels", None)
            frames = [] if t.dim() == 4 else [int(t.shape[1 if t.shape[2] == channels else 2])]
            ctx.patch_grid = (*frames, rows, cols)
            return


def bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind inputs to ``model.forward``, setting the kwargs tppc manages (``use_cache``)."""
    sig = inspect.signature(model.forward)
    for name, value in _MANAGED_KWARGS.items():
        if name in sig.parameters:
            if kwargs.get(name, value) != value:
                raise CaptureError(
                    f"{name}={kwargs[name]!r} was passed to {type(model).__name__}; tppc manages "
                    f"the key/value cache itself. fix: drop {name}= (tppc passes {name}={value})"
                )
            kwargs[name] = value
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise CaptureError(
            f"example inputs do not match {type(model).__name__}.forward{sig}: {exc}"
        ) from exc
    return bound


def _resolve_seq_dims(
    model: torch.nn.Module,
    bound: inspect.BoundArguments,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None,
) -> dict[str, tuple[int, ...]]:
    tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    if seq_dims is not None:
        out: dict[str, tuple[int, ...]] = {}
        for name, dims in seq_dims.items():
            if name not in tensors:
                raise CaptureError(
                    f"seq_dims names input {name!r}, but the tensor inputs of "
                    f"{type(model).__name__}.forward are {sorted(tensors)}; fix: use one of those"
                )
            dims_t = (dims,) if isinstance(dims, int) else tuple(dims)
            rank = tensors[name].dim()
            for d in dims_t:
                if not -rank <= d < rank:
                    raise CaptureError(
                        f"seq_dims[{name!r}] = {d}, but {name} has rank {rank} "
                        f"(shape {tuple(tensors[name].shape)}); fix: an axis in 0..{rank - 1}"
                    )
            out[name] = tuple(d % rank for d in dims_t)
        return out
    out = {name: dims for name, t in tensors.items()
           if (dims := _stream_axes(name, t)) is not None}
    for name, dims in out.items():
        _refuse_channels_last(model, name, tensors[name], dims)
    if not out:
        reasons = [_not_a_stream(k, v) for k, v in tensors.items()]
        found = "; ".join(what for what, _ in reasons) or "no tensor inputs"
        fix = next((fix for _, fix in reasons if fix), "pass seq_dims={'input': axis}")
        raise CaptureError(
            f"no sequence axis found among the inputs of {type(model).__name__}: {found}. "
            "tppc looks for token ids (batch, seq) of at least 2 tokens, embeddings (batch, "
            "seq, hidden), image latents (batch, channels, height, width) or video latents "
            f"(batch, frames, channels, height, width). fix: {fix}"
        )
    return _tie_to_main(out, tensors, _patch_size(model))


def _refuse_channels_last(model: torch.nn.Module, name: str, t: torch.Tensor,
                          dims: tuple[int, ...]) -> None:
    """Refuse a channels-last video latent ``(b, frames, h, w, channels)`` (Kandinsky 5):
    tppc's latent rule would take its width for patch rows (axis 3), whose bands are no
    contiguous tokens of the model's frame-, row-major order.

    Raises:
        CaptureError: naming the input, its shape, the config field and the fix.
    """
    config = getattr(model, "config", None)
    declared = {k: v for k in ("in_channels", "in_visual_dim")
                if isinstance(v := getattr(config, k, None), int)}
    if getattr(config, "visual_cond", False) and "in_visual_dim" in declared:
        declared["2 * in_visual_dim + 1"] = 2 * declared["in_visual_dim"] + 1
    field = next((k for k, v in declared.items() if v == t.shape[-1]), None)
    if dims != (3,) or t.dim() != 5 or field is None:
        return
    if field == "in_channels" and {int(t.shape[1]), int(t.shape[2])} & set(declared.values()):
        return  # channels on axis 1 or 2 as well: read as channels-first ("in_visual_dim"
        # is Kandinsky 5's name, whose latents are channels-last whatever their frames)
    raise CaptureError(
        f"input {name!r} of {type(model).__name__} is a channels-last video latent (batch, "
        f"frames, height, width, channels) of shape {tuple(t.shape)} (its last axis is "
        f"config.{field} = {t.shape[-1]}). tppc cuts latents (batch, [frames,] channels, "
        "height, width) into bands of patch rows and would cut this one along its width, "
        "whose bands are no contiguous tokens (a frame-, row-major token order); along the "
        "height or the frames the model's positional inputs pin the size. fix: run this model "
        "eagerly (tppc does not compile channels-last latents yet)")


def _not_a_stream(name: str, t: torch.Tensor) -> tuple[str, str]:
    """What an input is and why it is not a sequence input; the fix ('' if none fits)."""
    what = f"{name} is {str(t.dtype).removeprefix('torch.')} of shape {tuple(t.shape)}"
    if _CONTEXT_NAME.search(name):
        return f"{what} (named like a text-conditioning input)", ""
    if t.dim() in (2, 3) and t.shape[1] < 2 and (t.dim() == 2) != t.is_floating_point():
        return (f"{what}: {int(t.shape[1])} token(s)", "pass an example of at least 2 tokens "
                "(torch.export fixes an axis of size 0 or 1; the compiled pipeline then runs "
                "other lengths)")
    if t.dim() == 2 and t.is_floating_point():
        return (f"{what}: token ids are integers", f"pass {name} as integer token ids "
                f"({name}.long()), or seq_dims={{{name!r}: 1}} if it is a float sequence")
    return f"{what}: not a shape tppc recognises", f"pass seq_dims={{{name!r}: axis}}"


def _check_batch(model: torch.nn.Module, bound: inspect.BoundArguments) -> None:
    """Refuse an example with an empty batch: a capture of nothing plans nothing."""
    for name, t in bound.arguments.items():
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == 0:
            raise CaptureError(
                f"example input {name!r} of {type(model).__name__} has batch size 0 (shape "
                f"{tuple(t.shape)}). fix: pass an example with at least one sequence; the "
                "compiled pipeline then accepts other batch sizes")


_CONTEXT_NAME = re.compile(r"encoder|text|txt|prompt|caption|context|pooled|cond|added|mask_t5",
                           re.IGNORECASE)
"""Input names of the context stream (text conditioning): never a sequence axis."""


def _stream_axes(name: str, t: torch.Tensor) -> tuple[int, ...] | None:
    """The sequence axis of an input of the token stream, or None (context, scalars)."""
    if _CONTEXT_NAME.search(name):
        return None  # encoder_hidden_states, text masks, pooled projections, txt_ids
    if t.dim() == 2 and not t.is_floating_point() and t.shape[1] > 1:
        return (1,)  # token ids, position ids, attention masks: (batch, seq)
    if t.dim() == 4 and t.is_floating_point():
        return (2,)  # image latents (b, c, h, w): patch rows are the token axis
    if t.dim() == 5 and t.is_floating_point():
        return (3,)  # video latents (b, f, c, h, w) or (b, c, f, h, w): patch rows
    if t.dim() == 3 and t.is_floating_point() and t.shape[1] > 1:
        return (1,)  # embeddings or packed latents (b, seq, hidden)
    return None


def _tie_to_main(found: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor],
                 patch: int) -> dict[str, tuple[int, ...]]:
    """Keep the axes as long as the main (first) stream's; the others are context inputs.

    The main stream is the first input with a sequence axis; an input whose axis has another
    length (a text prompt of 6 tokens next to 16 image patches) is conditioning whose length
    stays constant, never tied to the image's.
    """
    main = next(iter(found))
    units = _units(tensors[main], found[main], patch)
    kept = {n: d for n, d in found.items() if _units(tensors[n], d, patch) == units}
    token_count = _tokens(tensors[main], found[main], patch)
    for name, t in tensors.items():  # position ids of packed latents (Flux's img_ids)
        if not t.is_floating_point() or _CONTEXT_NAME.search(name) or name in kept:
            continue
        if t.dim() == 2 and t.shape[0] == token_count:
            kept[name] = (0,)
        elif t.dim() == 3 and t.shape[2] == token_count != t.shape[1] and units == token_count:
            kept[name] = (2,)  # coordinates per token (LTX's video_coords (b, 3, tokens))
    return kept


def _units(t: torch.Tensor, dims: tuple[int, ...], patch: int) -> int:
    size = int(t.shape[dims[0]])
    return size // patch if is_latent(t, dims) else size


def _tokens(t: torch.Tensor, dims: tuple[int, ...], patch: int) -> int:
    if is_latent(t, dims):
        return int(t.shape[-1] * t.shape[-2]) // patch**2
    return int(t.shape[dims[0]])


def _patch_size(model: torch.nn.Module) -> int:
    """The side of a latent's patch: ``config.patch_size``, an int or ``(time, height,
    width)`` with height equal to width (Wan's ``(1, 2, 2)``), else 1."""
    for owner in (getattr(model, "config", None), model):
        p = getattr(owner, "patch_size", None)
        if isinstance(p, list | tuple) and len(p) >= 2 and p[-1] == p[-2]:
            p = p[-1]
        if isinstance(p, int) and p > 0:
            return p
    return 1

