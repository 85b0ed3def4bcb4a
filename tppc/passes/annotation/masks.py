"""Recognise masks tppc rebuilds per chunk from O(L) data: windows and padding.

A mask that depends only on positions and on integer inputs (``attention_mask``) is
classified by evaluating it at the probe lengths of :func:`probe_lengths` (never at the
example length): first with every candidate input set to ones, which must give a causal
band ``i - w < j ≤ i`` (``w`` found at the longest probe), causal blocks ``j ≤ i``,
``i // b == j // b`` (chunked attention; ``b`` the first row that sees only itself) or
all-visible keys; then with
random 0/1 inputs, which must give that pattern ``& key_valid[b, j]`` for
``key_valid = input != 0``. Anything else is refused with the node, its module and why.
A mask that reads the values of other inputs (a prompt's padding mask) is a key mask,
evaluated per call (:mod:`tppc.passes.annotation.key_masks`). A float mask whose visible entries are
not all 0 at some probe, or that reads a parameter or buffer (a learned table, zero at
initialisation), is an additive *bias*
(ALiBi, relative positions): its pattern is checked the same way and its values are
evaluated per chunk (``MaskSpec.bias``, :mod:`tppc.passes.chunking.bias_rows`).

Example:
    >>> mask_spec(sdpa.kwargs["attn_mask"], gm, ctx)              # doctest: +SKIP
    ('causal', MaskSpec(window=4096, key_valid='attention_mask'))
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.context import CompileContext
from tppc.ir.records import AttentionKind, MaskSpec
from tppc.passes.annotation.key_masks import key_mask_spec
from tppc.passes.annotation.positional import evaluate_positional
from tppc.passes.shapes import SHAPE_USES, ancestors, module_path, size_expr, tensor_val

__all__ = ["mask_literals", "mask_spec"]

_SENTINEL = 1 << 30
"""Integer constants this large are slice ends and dtype limits, not window sizes."""


def mask_spec(node: fx.Node, mask: fx.Node, gm: fx.GraphModule, ctx: CompileContext,
              lengths: tuple[int, ...]) -> tuple[AttentionKind, MaskSpec | None]:
    """The kind and structured form of the mask of attention ``node`` (see module docstring).

    Raises:
        AnnotationError: the mask is not a causal band or all-visible pattern, combined with
            at most one key-validity input; names the node and what was found.
    """
    closure = ancestors([mask])
    inputs = [p for p in gm.graph.find_nodes(op="placeholder")
              if p in closure and p.name in ctx.seq_inputs and _read_by_value(p, closure)]
    keys = key_mask_spec(node, mask, ctx)
    if keys is not None:  # its pattern depends on values the example fixes: per call
        return keys
    if len(inputs) > 1:
        raise _refuse(node, f"it reads several inputs by value ({[p.name for p in inputs]})")
    source = inputs[0] if inputs else None
    generator = torch.Generator().manual_seed(0)
    window: int | None = None
    block: int | None = None
    causal = True
    bias = False
    lengths = _runnable(node, mask, gm, ctx, lengths, source)
    for length in sorted(lengths, reverse=True):
        overrides = {} if source is None else {source: _filled(source, ctx, length, None)}
        value = evaluate_positional(mask, gm, ctx, length, overrides)
        bias = bias or _is_bias(value)
        allowed = _allowed4(value)
        base = allowed.all(dim=0).all(dim=0)
        if not bool((allowed == base).all()):
            raise _refuse(node, f"at length {length} it differs between sequences or heads "
                          "although every input is all ones")
        if length == max(lengths):
            causal, window, block = _band_of(base)
        _check_band(node, base, causal, window, length, block)
        if source is not None:
            values = _filled(source, ctx, length, generator)
            value = evaluate_positional(mask, gm, ctx, length, {source: values})
            bias = bias or _is_bias(value)
            got = _allowed4(value)
            valid = values.reshape(values.shape[0], -1).ne(0)[:, None, None, :]
            if not bool((got == (base & valid)).all()):
                raise _refuse(node, f"with random 0/1 values of input {source.name!r} at "
                              f"length {length} it is not (pattern & {source.name}[b, key] != 0)")
    kind: AttentionKind = "causal" if causal else "bidirectional"
    bias = bias or _reads_weights(mask, closure)  # a table that is 0 now may be trained
    if window is None and block is None and source is None and not bias:
        return kind, None
    if bias and block is not None:
        raise _refuse(node, f"it is a float bias over blocks of {block} keys (chunked "
                      "attention with a bias)")
    return kind, MaskSpec(window=window, key_valid=None if source is None else source.name,
                          bias=bias, block=block)


def _runnable(node: fx.Node, mask: fx.Node, gm: fx.GraphModule, ctx: CompileContext,
              lengths: tuple[int, ...], source: fx.Node | None) -> tuple[int, ...]:
    """``lengths`` with the longest probe lowered to the longest length the mask's
    computation runs at, when it fails beyond (MPT slices its ALiBi table of ``max_seq_len``
    rows by the length: the model runs at no longer length, in eager either). That length
    is recorded as the capture's limit (``ctx.length_limit``); a longer call is refused."""
    long = max(lengths)
    candidates = sorted((v for v in mask_literals(mask) if min(lengths) < v < long),
                        reverse=True)
    error: Exception | None = None
    for length in [long, *candidates]:
        overrides = {} if source is None else {source: _filled(source, ctx, length, None)}
        try:
            evaluate_positional(mask, gm, ctx, length, overrides)
        except RuntimeError as exc:
            error = error or exc
            continue
        if length < long and error is not None:
            limit = min(length, ctx.length_limit[0]) if ctx.length_limit else length
            ctx.length_limit = (limit, f"the mask of {module_path(node) or node.name} does not "
                                f"evaluate at {long} tokens ({str(error).splitlines()[0]})")
        return tuple(sorted({*(v for v in lengths if v < length), length}))
    raise _refuse(node, f"its computation fails at every probe length from {long} down "
                  f"({type(error).__name__}: {str(error).splitlines()[0]})")


def mask_literals(mask: fx.Node) -> set[int]:
    """The integer constants (absolute values) of ``mask``'s computation: window sizes, table
    lengths; not slice ends or dtype limits (:data:`_SENTINEL` and above)."""
    flat = torch.utils._pytree.tree_leaves([(n.args, n.kwargs) for n in ancestors([mask])])
    return {abs(a) for a in flat if isinstance(a, int) and not isinstance(a, bool)
            and abs(a) < _SENTINEL}


def _reads_weights(mask: fx.Node, closure: set[fx.Node]) -> bool:
    """Whether a float mask reads a parameter or buffer: a bias whatever its values now."""
    val = tensor_val(mask)
    return val is not None and val.dtype.is_floating_point \
        and any(n.op == "get_attr" for n in closure)


def _is_bias(mask: torch.Tensor) -> bool:
    """Whether a float mask adds something other than 0 to the scores of a visible key."""
    if not mask.dtype.is_floating_point:
        return False
    visible = mask > torch.finfo(mask.dtype).min / 2
    return bool((mask[visible] != 0).any())


def _read_by_value(p: fx.Node, closure: set[fx.Node]) -> bool:
    return any(u in closure and u.target not in SHAPE_USES for u in p.users)


def _filled(p: fx.Node, ctx: CompileContext, length: int,
            generator: torch.Generator | None) -> torch.Tensor:
    """Ones (no generator), or random 0/1 with a padded prefix and suffix in some rows.

    ``length`` is a value of the sequence symbol, which counts blocks of ``k`` tokens in a
    block capture: the input's shape is its symbolic shape at ``length``."""
    val = tensor_val(p)
    shape = [int(size_expr(s).subs(ctx.seq_symbol, length)) for s in val.shape]
    if generator is None:
        return torch.ones(shape, dtype=val.dtype)
    values = torch.randint(0, 2, shape, generator=generator)
    pad = shape[-1] // 3
    values[0, ..., :pad] = 0  # left padding
    if shape[0] > 1 and pad:
        values[-1, ..., -pad:] = 0  # right padding
    return values.to(val.dtype)


def _allowed4(mask: torch.Tensor) -> torch.Tensor:
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    return allowed.reshape(-1, *allowed.shape[-3:])


def _band_of(base: torch.Tensor) -> tuple[bool, int | None, int | None]:
    """(causal, window, block) read off the longest probe's pattern (checked by the
    caller): a block when a row after the first sees only itself."""
    n_q, n_k = base.shape[-2:]
    if bool(base.all()):
        return False, None, None
    widths = base.sum(-1)
    alone = [i for i in range(1, n_q) if int(widths[i]) == 1 and n_q == n_k]
    if alone:
        return True, None, alone[0]
    width = int(widths[-1])
    return True, (width if width < n_k else None), None


def _check_band(node: fx.Node, base: torch.Tensor, causal: bool, window: int | None,
                length: int, block: int | None = None) -> None:
    n_q, n_k = base.shape[-2:]
    if not causal:
        if not bool(base.all()):
            raise _refuse(node, f"at length {length} it hides keys but is not causal")
        return
    rows = torch.arange(n_q)[:, None] + (n_k - n_q)
    keys = torch.arange(n_k)
    expected = keys <= rows
    if window is not None:
        expected = expected & (keys > rows - window)
    if block is not None:
        expected = expected & (keys // block == rows // block)
    if not bool((base == expected).all()):
        what = "causal" if window is None else f"a causal window of {window} keys"
        what = what if block is None else f"causal in blocks of {block} keys"
        raise _refuse(node, f"at length {length} its pattern is not {what}")


def _refuse(node: fx.Node, why: str) -> AnnotationError:
    return AnnotationError(
        f"attention node {node.name!r} (module {module_path(node) or '<top level>'}) has a mask "
        f"tppc cannot rebuild per chunk: {why}. tppc supports causal, sliding-window, "
        "chunked (causal blocks) and all-visible masks combined with a padding mask "
        "(attention_mask). fix: use one of those"
    )
