"""The batch cut of a stage graph (CFG parallelism): each worker computes its part of the
call's batch (classifier-free guidance: the conditional and unconditional halves).

Terms:
    batch: the size of axis 0 of the stage's token inputs whose token axis is not 0 (a
        latent ``(B, C, H, W)``, hidden states ``(B, T, D)``); inputs whose token axis is 0
        (Flux's ``img_ids``) have no batch axis.
    origin: what enters cut: those token inputs (narrowed to the worker's part here),
        boundary values with the batch on axis 0 (cut by the previous stage's worker),
        K/V buffers with the batch on axis 0 (one per worker, of the part's size).
    flow: the cut goes through every op by the sharding rules
        (:func:`tppc.passes.sharding.cuts.flow`), with the rules of ops that are batch-wise
        here (linears, convolutions, group norms, embeddings, attention, cat, matmul); a whole
        operand that meets a cut one with the full batch on the same axis (a timestep
        embedding, text states) is narrowed to the part where they meet; literal batch sizes
        (a view's ``[2, ...]``) are divided.
    refusal: an op that mixes batch elements (a reduction or a split over the batch) is
        refused by name; so is a batch the degree does not divide.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import CHUNK_INPUT, LAYER, STAGE_INFO, TOKEN
from tppc.passes.sharding.annotate_shards import linear_of
from tppc.passes.sharding.cuts import Conflict, Cut, Refine, flow, sizes_of
from tppc.passes.sharding.shard_graph import MARKS

__all__ = ["batch_cut"]

aten = torch.ops.aten
_SIZED = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.expand.default}
_CONV = {aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
         aten.convolution.default, aten._convolution.default}
_CHUNK_ATTENTION = torch.ops.tppc.chunk_attention.default
_ATTENTION = {aten.scaled_dot_product_attention.default, _CHUNK_ATTENTION,
              torch.ops.tppc.softmax_attention.default}
_NO_VALUE = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
             aten._assert_tensor_metadata.default, aten._assert_scalar.default}


def batch_cut(gm: fx.GraphModule, part: int, parts: int, what: str) -> dict[fx.Node, int]:
    """Cut ``gm``'s batch for worker ``part`` of ``parts`` (in place; module docstring).

    Returns:
        The cut axis of every node whose value is cut.

    Raises:
        SpecError: the batch does not divide, or an op mixes batch elements.
    """
    if parts == 1:
        return {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    batch = _batch(placeholders, what)
    if batch % parts:
        raise SpecError(f"{what}: cfg_parallel={parts} cuts the batch of {batch} into equal "
                        f"parts; it does not divide. fix: a batch divisible by {parts} (a "
                        "guided batch holds both halves), or cfg_parallel=1")
    consts = [ph for ph in placeholders if _const_origin(ph, batch)]
    for extra in (consts, []):  # whole consts (narrowed where they meet) if any conflicts
        try:
            cuts, narrow = _analyse(gm, placeholders, extra, batch)
            break
        except (Conflict, Refine) as err:
            if extra:
                continue
            node, why = err.args[-1] if isinstance(err.args[-1], tuple) else (None, "")
            raise SpecError(
                f"{what}: cfg_parallel={parts} cuts the batch ({batch}) over the workers, but "
                f"{node.name} ({node.target}) mixes batch elements: {why}. fix: "
                "cfg_parallel=1 for this model") from None
    info = gm.meta.get(STAGE_INFO)
    if info is not None and info.outputs:
        _check_boundary(gm, cuts, batch, what)
    _rewrite(gm, cuts, narrow, part, parts, batch)
    return {n: c.axis for n, c in cuts.items() if isinstance(c, Cut)}


def _analyse(gm: fx.GraphModule, placeholders: list[fx.Node], consts: list[fx.Node],
             batch: int) -> tuple[dict[fx.Node, Any], dict[fx.Node, list]]:
    """Every node's cut and the whole operands to narrow; a failing op is raised with
    ``(node, reason)`` as the error's last argument."""
    cuts: dict[fx.Node, Any] = {}
    narrow: dict[fx.Node, list] = {}
    for ph in placeholders:
        if _origin(ph, batch) or ph in consts:
            cuts[ph] = Cut(0, (sizes_of(ph)[0] if ph.meta[CHUNK_INPUT].kind not in (
                "key", "value") else batch,), frozenset({ph.name}))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _NO_VALUE or \
                not any(cuts.get(a) is not None for a in node.all_input_nodes):
            continue
        try:
            cuts[node], found = _flow(node, cuts, batch)
        except (Conflict, Refine) as err:
            why = err.reason if isinstance(err, Conflict) else "a split across the batch"
            err.args = (*err.args, (node, why))
            raise
        if found:
            narrow[node] = found
    return cuts, narrow


def _check_boundary(gm: fx.GraphModule, cuts: dict, batch: int, what: str) -> None:
    """The next stage's workers take a boundary value cut on axis 0 when its token axis is
    not 0 and its axis 0 is a multiple of the batch (:func:`_origin`), else whole: refuse a
    value that leaves otherwise."""
    for value in gm.graph.output_node().all_input_nodes:
        info, shape, cut = value.meta.get(TOKEN), sizes_of(value), cuts.get(value)
        taken = info is not None and info.axis not in (None, 0) and bool(shape) and \
            isinstance(shape[0], int) and shape[0] % batch == 0
        have = isinstance(cut, Cut) and cut.axis == 0
        if taken != have:
            state = f"cut on axis {cut.axis}" if isinstance(cut, Cut) else "whole"
            raise SpecError(f"{what}: boundary value {value.name} leaves {state}; the next "
                            f"stage's workers take it {'cut on axis 0' if taken else 'whole'}."
                            " fix: cfg_parallel=1 for this model")


def _const_origin(ph: fx.Node, batch: int) -> bool:
    """A whole input with the batch on axis 0 (timesteps, text states, pooled embeddings):
    cut from the start when nothing objects (else narrowed where it meets cut values)."""
    spec, shape = ph.meta.get(CHUNK_INPUT), sizes_of(ph)
    return spec is not None and spec.kind in ("const", "hoisted", "full") and bool(shape) and \
        shape[0] == batch


def _batch(placeholders: list[fx.Node], what: str) -> int:
    sizes = {}
    for kind in ("token", "boundary"):  # a later stage: its boundary values
        for ph in placeholders:
            spec, shape = ph.meta.get(CHUNK_INPUT), sizes_of(ph)
            if spec is not None and spec.kind == kind and spec.axis not in (None, 0) and shape:
                sizes[ph.name] = shape[0]
        if sizes:
            break
    if not sizes:
        raise SpecError(f"{what}: no token input with a batch axis (axis 0 beside its token "
                        "axis); tppc cannot find the batch to cut. fix: cfg_parallel=1")
    batch = min(sizes.values()) if all(isinstance(v, int) for v in sizes.values()) else 0
    if not batch or any(v % batch for v in sizes.values()):
        raise SpecError(f"{what}: the token inputs disagree on the batch (axis 0: {sizes}). "
                        "fix: cfg_parallel=1")
    return batch


def _origin(ph: fx.Node, batch: int) -> bool:
    spec = ph.meta.get(CHUNK_INPUT)
    if spec is None:
        return False
    if spec.kind in ("key", "value"):
        return bool(spec.shape) and spec.shape[0] == batch
    shape = sizes_of(ph)  # (B·F, ...): frames folded into the batch, batch-major
    return spec.kind in ("token", "boundary") and spec.axis not in (None, 0) and \
        bool(shape) and isinstance(shape[0], int) and shape[0] % batch == 0


def _flow(node: fx.Node, cuts: dict, batch: int) -> tuple[Any, list]:
    """The node's cut, and the whole operands to narrow (``[(arg, axis, segments)]``)."""
    target, args = node.target, node.args
    cut = next(cuts[a] for a in node.all_input_nodes if cuts.get(a) is not None)
    if target in MARKS:
        if MARKS[target] == "all_gather" and args[1] == cut.axis:
            raise Conflict(cut.origins, "a gather along the batch")
        return cut, []
    lin = linear_of(node)
    if lin is not None and cuts.get(lin.x) is not None:
        x_cut = cuts[lin.x]
        if x_cut.axis == len(sizes_of(lin.x)) - 1:
            raise Conflict(x_cut.origins, "a linear over the batch axis")
        return x_cut, []
    if target in _CONV or target in (aten.native_group_norm.default, aten.group_norm.default):
        if cuts.get(args[0]) is None or cuts[args[0]].axis != 0 or any(
                cuts.get(a) is not None for a in node.all_input_nodes[1:]):
            raise Conflict(cut.origins, "a convolution or group norm with a cut weight or "
                           "off the batch axis")
        return ([cut, cut.moved(0), cut.moved(0)] if target == aten.native_group_norm.default
                else cut), []
    if target == aten.flatten.using_ints:
        nd = len(sizes_of(args[0]))
        lo, hi = ((a + nd if a < 0 else a) for a in (*args[1:3], 0, -1)[:2])
        if lo < cut.axis <= hi:
            raise Conflict(cut.origins, "flattens the batch axis into an outer one")
        return cut.moved(cut.axis - (hi - lo) if cut.axis > hi else cut.axis), []
    if target == aten.unflatten.int:
        nd = len(sizes_of(args[0]))
        dim, sizes = args[1] % nd, list(args[2])
        if dim == cut.axis and not (isinstance(sizes[0], int) and sizes[0] % batch == 0):
            raise Conflict(cut.origins, f"unflattens the batch axis into {sizes}")
        return cut.moved(cut.axis + (len(sizes) - 1) * (dim < cut.axis)), []
    if target in (aten.copy.default, aten.slice_scatter.default):
        nd = len(sizes_of(node))
        if target == aten.slice_scatter.default and (args[2] if len(args) > 2 else 0) % nd \
                == cuts[_first_cut(list(args[:2]), cuts)].axis:
            raise Conflict(cut.origins, "scatters along the batch axis")
        return _batched(node, cuts, cut, batch, contracts=False)
    if target in (aten.pad.default, aten.constant_pad_nd.default):
        if cut.axis >= len(sizes_of(args[0])) - len(args[1]) // 2:
            raise Conflict(cut.origins, "pads the batch axis")
        return cut, []
    if target == aten.unbind.int:
        dim = args[1] if len(args) > 1 else 0
        dim = dim + len(sizes_of(args[0])) if dim < 0 else dim
        if dim == cut.axis:
            raise Conflict(cut.origins, "unbinds the batch axis")
        return [cut.moved(cut.axis - (dim < cut.axis))] * sizes_of(args[0])[dim], []
    if target == aten.einsum.default:
        return _einsum(node, cuts, cut, batch)
    if target == aten.embedding.default:
        return cuts[args[1]], []
    if target == aten.copy_.default:
        have, want = cuts.get(args[0]), cuts.get(args[1])
        if have is None or want is None or have.axis != want.axis:
            raise Conflict(cut.origins, "a copy between a cut and a whole value")
        return have, []
    if target == aten.type_as.default:  # the second operand gives only its dtype
        return cuts.get(args[0]), []
    if target == aten.stack.default:
        return _stack(node, cuts, cut, batch)
    if target in _ATTENTION or target in (aten.cat.default, aten.matmul.default,
                                          aten.bmm.default, aten.baddbmm.default):
        return _batched(node, cuts, cut, batch)
    return flow(node, cuts)


def _batched(node: fx.Node, cuts: dict, cut: Cut, batch: int, contracts: bool = True
             ) -> tuple[Cut, list]:
    """Attention, cat and matmul over a batch cut: every tensor operand cut on the same
    (right-aligned) axis, or whole with the full batch there (narrowed) or 1 (broadcast).
    ``cat`` aligns left, along another axis than the cut one."""
    if node.target == aten.cat.default:
        tensors, dim = list(node.args[0]), node.args[1] if len(node.args) > 1 else 0
        out, left = len(sizes_of(node)), True
        if dim % out == cut.axis + out - len(sizes_of(_first_cut(tensors, cuts))):
            raise Conflict(cut.origins, "concatenates along the batch")
    else:
        tensors = [a for a in node.args if isinstance(a, fx.Node) and sizes_of(a) is not None]
        out, left = len(sizes_of(node)), False
    valid = node.args[8] if node.target == _CHUNK_ATTENTION and len(node.args) > 8 else None
    if isinstance(valid, fx.Node):  # key_valid (batch, keys): the batch on axis 0
        tensors.remove(valid)
        got = cuts.get(valid)
        if (got is not None and got.axis != 0) or sizes_of(valid)[0] not in (1, batch):
            raise Conflict(cut.origins, f"a key mask {valid.name} off the batch axis")
        extra = [(valid, 0, (batch,))] if got is None and sizes_of(valid)[0] == batch else []
        if not any(cuts.get(t) is not None for t in tensors):
            raise Conflict(cut.origins, "attention whose queries are whole beside a cut mask")
        cut_, found = _batched_tensors(node, cuts, tensors, out, left, contracts, batch)
        return cut_, found + extra
    return _batched_tensors(node, cuts, tensors, out, left, contracts, batch)


def _batched_tensors(node: fx.Node, cuts: dict, tensors: list, out: int, left: bool,
                     contracts: bool, batch: int) -> tuple[Cut, list]:
    cut = cuts[_first_cut(tensors, cuts)]
    first = _first_cut(tensors, cuts)
    at = cut_at = cuts[first].axis + (0 if left else out - len(sizes_of(first)))
    if contracts and cut_at >= out - 2 and node.target != aten.cat.default:
        raise Conflict(cut.origins, "contracts or attends over the batch axis")
    found = []
    for arg in tensors:
        shape = sizes_of(arg)
        at = cut_at - (0 if left else out - len(shape))
        got = cuts.get(arg)
        if got is not None:
            if got.axis != at:
                raise Conflict(got.origins | cut.origins, "operands cut on different axes")
        elif at >= 0 and shape[at] == batch:
            found.append((arg, at, (batch,)))
        elif at >= 0 and shape[at] != 1:
            raise Conflict(cut.origins, f"a whole operand {arg.name} of size {shape[at]} on "
                           "the batch axis")
    return cut.moved(cut_at), found


def _stack(node: fx.Node, cuts: dict, cut: Cut, batch: int) -> tuple[Cut, list]:
    """``stack`` along a new axis: every operand cut on the same axis, or narrowed."""
    tensors = list(node.args[0])
    nd = len(sizes_of(tensors[0]))
    dim = node.args[1] if len(node.args) > 1 else 0
    dim = dim + nd + 1 if dim < 0 else dim
    found = []
    for arg in tensors:
        got = cuts.get(arg)
        if got is not None and got.axis != cut.axis:
            raise Conflict(cut.origins, "stacks operands cut on different axes")
        if got is None:
            if sizes_of(arg)[cut.axis] != batch:
                raise Conflict(cut.origins, f"stacks a whole operand {arg.name} beside cut ones")
            found.append((arg, cut.axis, (batch,)))
    return cut.moved(cut.axis + (dim <= cut.axis)), found


def _einsum(node: fx.Node, cuts: dict, cut: Cut, batch: int) -> tuple[Cut, list]:
    """An einsum whose batch letter stays in the output (no sum over it): every operand that
    holds the letter is cut there or narrowed."""
    ins, _, out = node.args[0].replace(" ", "").partition("->")
    specs, tensors = ins.split(","), list(node.args[1])
    first = _first_cut(tensors, cuts)
    letter = specs[tensors.index(first)][cuts[first].axis]
    if not out or letter not in out or "." in ins:
        raise Conflict(cut.origins, f"einsum {node.args[0]!r} sums over the batch letter")
    found = []
    for spec, arg in zip(specs, tensors, strict=True):
        got = cuts.get(arg)
        at = spec.find(letter)
        if got is not None and got.axis != at:
            raise Conflict(cut.origins, f"einsum {node.args[0]!r}: operands cut on other letters")
        if got is None and at >= 0 and sizes_of(arg)[at] == batch:
            found.append((arg, at, (batch,)))
    return cut.moved(out.index(letter)), found


def _first_cut(tensors: list, cuts: dict) -> fx.Node:
    return next(t for t in tensors if cuts.get(t) is not None)


def _rewrite(gm: fx.GraphModule, cuts: dict, narrow: dict, part: int, parts: int,
             batch: int) -> None:
    graph = gm.graph
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for node in list(graph.nodes):
        cut = cuts.get(node)
        if node.op == "placeholder" and cut is not None:
            spec = node.meta[CHUNK_INPUT]
            if spec.kind in ("key", "value"):
                shape = list(spec.shape)
                shape[0] //= parts
                node.meta[CHUNK_INPUT] = type(spec)(**{**spec.__dict__, "shape": tuple(shape)})
            elif spec.kind in ("token", "const", "hoisted", "full"):
                step = cut.segments[0] // parts
                with graph.inserting_after(last):
                    got = _new(graph, aten.narrow.default, (node, 0, part * step, step), node)
                node.replace_all_uses_with(got, delete_user_cb=lambda u, g=got: u is not g)
            continue
        if isinstance(cut, Cut) and node.target in _SIZED and isinstance(node.args[1],
                                                                       (list, tuple)):
            sizes = list(node.args[1])
            if isinstance(sizes[cut.axis], int) and sizes[cut.axis] != -1:
                sizes[cut.axis] //= parts
                node.args = (node.args[0], sizes, *node.args[2:])
        if node.target == aten.native_group_norm.default and cut is not None:
            args = list(node.args)
            args[3] = args[3] // parts if isinstance(args[3], int) else args[3]
            node.args = tuple(args)
        if node.target == aten.unflatten.int and cut is not None and \
                node.args[1] % len(sizes_of(node.args[0])) == cut.axis:
            sizes = list(node.args[2])
            sizes[0] = sizes[0] // parts if sizes[0] != -1 else -1
            node.args = (node.args[0], node.args[1], sizes)
        for arg, axis, segments in narrow.get(node, ()):
            step = segments[0] // parts
            with graph.inserting_before(node):
                got = _new(graph, aten.narrow.default, (arg, axis, part * step, step), node)
            node.replace_input_with(arg, got)


def _new(graph: fx.Graph, target: Any, args: tuple, like: fx.Node) -> fx.Node:
    made = graph.call_function(target, args)
    if LAYER in like.meta:
        made.meta[LAYER] = like.meta[LAYER]
    return made
