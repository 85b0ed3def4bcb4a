"""One worker's shard of a stage graph: the parts of the cut weights, the sizes it sees, and
the collectives marked where the values must be whole again.

Terms:
    part ``r`` of ``t``: of an axis cut into ``segments``, worker ``r`` holds rows
        ``[off + r·L/t, off + (r+1)·L/t)`` of every segment ``(off, L)``, in order
        (:func:`take`).
    collective mark: a call of :func:`all_reduce_mark` (after a row-parallel linear, before
        its bias) or :func:`all_gather_mark` (a cut value the graph returns); marks never run:
        :mod:`tppc.passes.sharding.split_parts` cuts the graph at them and the program runs
        each as a collective action of the stage's group.

The analysis (:func:`tppc.passes.sharding.annotate_shards.analyse`) runs on the stage graph
itself, so a stage shards alone, at its own degree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import CHUNK_INPUT, LAYER
from tppc.passes.sharding.annotate_shards import Sharding, analyse, check_degree, linear_of
from tppc.passes.sharding.cuts import Cut
from tppc.passes.subgraph import copy_graph

__all__ = ["MARKS", "PARTS_OF", "PartOf", "all_gather_mark", "all_reduce_mark", "all_to_all_mark",
           "cuttable", "mark_dims", "ring_shift_mark", "shard_graph", "take"]

aten = torch.ops.aten


def all_reduce_mark(x: torch.Tensor, group: str = "tp") -> torch.Tensor:
    """Marks an all-reduce of ``x`` over the worker's group of mesh axis ``group``
    (:mod:`tppc.program.mesh`; never runs)."""
    raise RuntimeError("a collective mark runs only once its graph is split into parts")


def all_gather_mark(x: torch.Tensor, axis: int, group: str = "tp") -> torch.Tensor:
    """Marks an all-gather of ``x`` on ``axis`` over the worker's group of mesh axis
    ``group`` (never runs)."""
    raise RuntimeError("a collective mark runs only once its graph is split into parts")


def all_to_all_mark(x: torch.Tensor, split_axis: int, cat_axis: int,
                    group: str = "ulysses") -> torch.Tensor:
    """Marks an all-to-all of ``x`` over the worker's group of mesh axis ``group``: cut into
    equal parts on ``split_axis``, part ``r`` to member ``r``, the parts received joined on
    ``cat_axis`` (never runs)."""
    raise RuntimeError("a collective mark runs only once its graph is split into parts")


def ring_shift_mark(x: torch.Tensor, group: str = "ring") -> torch.Tensor:
    """Marks a ring shift of ``x`` over the worker's group of mesh axis ``group``: member
    ``r`` sends ``x`` to member ``r + 1`` and gets member ``r - 1``'s (modulo the group's
    size; never runs)."""
    raise RuntimeError("a collective mark runs only once its graph is split into parts")


MARKS = {all_reduce_mark: "all_reduce", all_gather_mark: "all_gather",
         all_to_all_mark: "all_to_all", ring_shift_mark: "ring_shift"}
"""Each mark and the collective it stands for."""


def mark_dims(mark: fx.Node) -> tuple[tuple[int, ...], str]:
    """A mark node's collective axes (``Action.dims``) and its group's mesh axis."""
    kind = MARKS[mark.target]
    n = {"all_reduce": 0, "all_gather": 1, "all_to_all": 2, "ring_shift": 0}[kind]
    args = list(mark.args[1:])
    dims = tuple(int(a) for a in args[:n])
    group = mark.kwargs.get("group", args[n] if len(args) > n else "tp")
    return dims, str(group)

PARTS_OF = "tppc.parts_of"
"""Shard ``GraphModule.meta`` key: ``{attribute name: PartOf}`` of every part it holds (a rank
that loads only its shard reads the parts from a checkpoint's whole tensors)."""


@dataclass(frozen=True)
class PartOf:
    """Where a shard's attribute comes from: :func:`take` of the stage graph's tensor
    ``target`` (its model name) with these arguments."""

    target: str
    axis: int
    segments: tuple[int, ...]
    rank: int
    degree: int

_SIZED = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.expand.default)


def take(tensor: torch.Tensor, axis: int, segments: tuple[int, ...], rank: int,
         degree: int) -> torch.Tensor:
    """Part ``rank`` of ``degree`` of ``tensor``'s ``axis`` cut into ``segments``: a view of
    ``tensor`` when the part is one contiguous block (rows of one segment: the shard shares
    the model's storage, as an unsharded stage does), else a contiguous copy."""
    pieces, off = [], 0
    for size in segments:
        step = size // degree
        pieces.append(tensor.narrow(axis, off + rank * step, step))
        off += size
    if len(pieces) > 1:
        return torch.cat(pieces, axis).contiguous()
    return pieces[0] if pieces[0].is_contiguous() else pieces[0].contiguous()


def cuttable(gm: fx.GraphModule) -> bool:
    """Whether anything in ``gm`` is cut over a group (a row-parallel linear or a gather)."""
    result = analyse(gm)
    return any(role.kind == "row" for role in result.roles.values()) or bool(result.gathered)


def shard_graph(gm: fx.GraphModule, rank: int, degree: int, what: str) -> fx.GraphModule:
    """Worker ``rank``'s shard (of ``degree``) of stage graph ``gm`` (a copy; ``gm`` stays).

    Raises:
        SpecError: a cut axis of the graph does not divide into ``degree`` parts, or nothing
            in it can be cut.
    """
    new = copy_graph(gm)
    new.meta.update(gm.meta)
    for name in ("tppc_positional", "tppc_consts"):
        if hasattr(gm, name):
            setattr(new, name, getattr(gm, name))
    result = analyse(new)
    check_degree(result.sizes, degree, what)
    if not any(role.kind == "row" for role in result.roles.values()) and not result.gathered:
        why = "; ".join(f"{origin}: {reason}" for origin, reason in result.notes[:3])
        raise SpecError(f"{what}: nothing in it can be cut over tensor_parallel={degree} "
                        f"workers ({why or 'it has no linear layer'}); each worker would "
                        "compute all of it. fix: tensor_parallel=1 for this stage")
    _Shard(new, result, rank, degree).run()
    _drop_whole_weights(new)
    new.graph.lint()
    new.recompile()
    return new


def _drop_whole_weights(gm: fx.GraphModule) -> None:
    """Remove the weights no node reads any more (replaced by their parts): a worker holds
    only its share."""
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if node.users:
            continue
        gm.graph.erase_node(node)
        if any(n.target == node.target for n in gm.graph.find_nodes(op="get_attr")):
            continue
        owner_path, _, name = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        owner._parameters.pop(name, None)
        owner._buffers.pop(name, None)


class _Shard:
    """The rewrite of one graph for one worker (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, result: Sharding, rank: int, degree: int) -> None:
        self.gm, self.result, self.rank, self.degree = gm, result, rank, degree
        self.graph = gm.graph
        self.count = 0
        self.whole: dict[fx.Node, fx.Node] = {}  # a row-parallel linear -> its summed value

    def run(self) -> None:
        for node in list(self.graph.nodes):
            role = self.result.roles.get(node)
            lin = linear_of(node)
            if lin is not None and role is not None and role.kind == "row":
                self._row(node, lin, role.segments)
            elif lin is not None and node in self.result.cuts and \
                    self.result.cuts.get(lin.x) is None:
                cut = self.result.cuts[node]
                self._param(lin.via or node, lin.weight, lin.out_axis, cut.segments)
                if isinstance(lin.bias, fx.Node):
                    self._param(node, lin.bias, 0, cut.segments)
            elif node in self.result.cuts:
                self._sizes(node)
            for arg, axis, segments in self.result.parts.get(node, ()):
                self._part(node, arg, axis, segments)
            if node.target in _NORMS and _cut_last(self.result.cuts.get(node.args[0])
                                                   , node.args[0]):
                self._norm(node)
            if node.op == "placeholder" and node in self.result.cuts:
                self._buffer(node)
        for node in self.result.gathered:
            self._gather(node)

    def _param(self, user: fx.Node, param: fx.Node, axis: int,
               segments: tuple[int, ...]) -> None:
        """Point ``user`` at part ``rank`` of parameter ``param`` (a new attribute)."""
        tensor = self.gm.get_submodule("").get_parameter(param.target) \
            if _is_param(self.gm, param.target) else _attr(self.gm, param.target)
        name = f"tp_{param.name}_{axis}_" + "_".join(map(str, segments))
        if not hasattr(self.gm, name):
            part = take(tensor.detach(), axis, segments, self.rank, self.degree)
            self.gm.register_parameter(name, torch.nn.Parameter(part, requires_grad=False))
            self.gm.meta.setdefault(PARTS_OF, {})[name] = PartOf(
                str(param.target), axis, tuple(segments), self.rank, self.degree)
        with self.graph.inserting_before(user):
            got = self.graph.get_attr(name)
        got.meta.update(param.meta)
        user.replace_input_with(param, got)

    def _row(self, node: fx.Node, lin, segments: tuple[int, ...]) -> None:
        """A row-parallel linear: its weight's columns cut, an all-reduce, then the bias."""
        self._param(lin.via or node, lin.weight, lin.in_axis, segments)
        weight = node.args[1] if node.target == aten.linear.default else node.args[-1]
        bias = lin.bias
        if bias is not None:
            if node.target == aten.linear.default:
                node.args = (node.args[0], weight)
            else:  # addmm(bias, x, w) -> mm(x, w)
                node.target, node.args = aten.mm.default, (node.args[1], weight)
        with self.graph.inserting_after(node):
            mark = self._new(all_reduce_mark, (node,), node)
        node.replace_all_uses_with(mark, delete_user_cb=lambda u: u is not mark)
        self.whole[node] = mark
        if bias is not None:
            with self.graph.inserting_after(mark):
                added = self._new(aten.add.Tensor, (mark, bias), node)
            mark.replace_all_uses_with(added, delete_user_cb=lambda u: u is not added)
            self.whole[node] = added

    def _sizes(self, node: fx.Node) -> None:
        """The sizes a reshape, expand or split names on the cut axis, divided."""
        cut = self.result.cuts[node]
        if node.target in _SIZED and isinstance(node.args[1], (list, tuple)):
            sizes = list(node.args[1])
            at = cut.axis
            if isinstance(sizes[at], int) and sizes[at] != -1:
                sizes[at] //= self.degree
                node.args = (node.args[0], sizes, *node.args[2:])
            return
        if node.target == aten.unflatten.int:  # (x, dim, sizes): the sizes from dim on
            sizes, at = list(node.args[2]), cut.axis - _dim(node, 1)
            if 0 <= at < len(sizes) and isinstance(sizes[at], int) and sizes[at] != -1:
                sizes[at] //= self.degree
                node.args = (node.args[0], node.args[1], sizes)
            return
        src = self.result.cuts.get(node.args[0]) if node.args else None
        if not isinstance(src, Cut):
            return
        args = list(node.args)
        if node.target == aten.split_with_sizes.default and _dim(node, 2) == src.axis:
            args[1] = [s // self.degree for s in args[1]]
        elif node.target == aten.split.Tensor and _dim(node, 2) == src.axis:
            args[1] //= self.degree
        elif node.target == aten.slice.Tensor and _dim(node, 1) == src.axis:
            for k in (2, 3):
                if len(args) > k and isinstance(args[k], int) and args[k] < 2 ** 62:
                    args[k] //= self.degree
        node.args = tuple(args)

    def _part(self, user: fx.Node, arg: fx.Node, axis: int, segments: tuple[int, ...]) -> None:
        """``user`` reads part ``rank`` of whole operand ``arg``."""
        arg = self.whole.get(arg, arg)
        if arg.op == "get_attr":
            self._param(user, arg, axis, segments)
            return
        with self.graph.inserting_before(user):
            pieces, off = [], 0
            for size in segments:
                step = size // self.degree
                pieces.append(self._new(aten.narrow.default,
                                        (arg, axis, off + self.rank * step, step), user))
                off += size
            got = pieces[0] if len(pieces) == 1 else self._new(
                aten.cat.default, (pieces, axis), user)
        user.replace_input_with(arg, got)

    def _norm(self, node: fx.Node) -> None:
        """A norm over the cut axis: the part's sums, all-reduced, then the norm (see
        :func:`tppc.passes.sharding.cuts.flow`'s norm rule)."""
        x, rms = node.args[0], node.target == aten.rms_norm.default
        size = sum(self.result.cuts[x].segments)
        args = list(node.args) + [None] * 5
        weight, bias = args[2], None if rms else args[3]
        eps = args[3] if rms else (1e-5 if args[4] is None else args[4])
        dtype = x.meta["val"].dtype
        eps = torch.finfo(dtype).eps if eps is None else eps

        def call(target, *a):
            return self._new(target, a, node)

        with self.graph.inserting_before(node):
            xf = call(aten.to.dtype, x, torch.float32)
            square = call(aten.mul.Tensor, xf, xf)
            stats = call(aten.sum.dim_IntList, square, [-1], True)
            if not rms:
                stats = call(aten.cat.default, [call(aten.sum.dim_IntList, xf, [-1], True),
                                                stats], -1)
            mark = call(all_reduce_mark, stats)
            mark.meta.pop("val", None)  # the sums' shape, not the norm's
            whole = call(aten.div.Scalar, mark, size)
            if rms:
                centred, var = xf, whole
            else:
                mean = call(aten.narrow.default, whole, -1, 0, 1)
                centred = call(aten.sub.Tensor, xf, mean)
                var = call(aten.sub.Tensor, call(aten.narrow.default, whole, -1, 1, 1),
                           call(aten.mul.Tensor, mean, mean))
            out = call(aten.mul.Tensor, centred,
                       call(aten.rsqrt.default, call(aten.add.Scalar, var, eps)))
            out = call(aten.to.dtype, out, dtype)
            if isinstance(weight, fx.Node):
                out = call(aten.mul.Tensor, out, weight)
            if isinstance(bias, fx.Node):
                out = call(aten.add.Tensor, out, bias)
        out.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _buffer(self, node: fx.Node) -> None:
        """A K/V buffer placeholder cut on its heads axis: its shape per worker."""
        spec, cut = node.meta[CHUNK_INPUT], self.result.cuts[node]
        shape = list(spec.shape)
        shape[cut.axis] = shape[cut.axis] // self.degree
        node.meta[CHUNK_INPUT] = type(spec)(**{**spec.__dict__, "shape": tuple(shape)})

    def _gather(self, node: fx.Node) -> None:
        """A cut value the graph returns: gathered whole first."""
        out = self.graph.output_node()
        with self.graph.inserting_before(out):
            mark = self._new(all_gather_mark, (node, self.result.cuts[node].axis), node)
        mark.meta.update({k: v for k, v in node.meta.items() if k == "val"})
        out.replace_input_with(node, mark)

    def _new(self, target, args: tuple, like: fx.Node) -> fx.Node:
        self.count += 1
        made = self.graph.call_function(target, args)
        if LAYER in like.meta:
            made.meta[LAYER] = like.meta[LAYER]
        if "val" in like.meta and target in (all_reduce_mark, aten.add.Tensor):
            made.meta["val"] = like.meta["val"]
        return made


_NORMS = (aten.rms_norm.default, aten.layer_norm.default)


def _cut_last(cut: object, x: object) -> bool:
    """Whether value ``x`` is cut on its last axis (a norm over it sums per worker)."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(cut, Cut) and val is not None and cut.axis == val.dim() - 1


def _dim(node: fx.Node, k: int) -> int:
    """The (non-negative) dim argument at position ``k`` of ``node``."""
    dim = node.args[k] if len(node.args) > k else node.kwargs.get("dim", 0)
    val = node.args[0].meta.get("val")
    return dim + val.dim() if dim < 0 and val is not None else dim


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
