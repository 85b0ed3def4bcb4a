"""THE op-rule table: what the annotation pass and the cost model know about each op.

Terms:
    role: how ``annotate_seq_dims`` treats the op when it reads a token value (like DTensor's
        sharding strategies, which say per op how ``Shard(dim)`` propagates):
        ``row_wise`` (the default: one result row per token row), ``attention`` (mixes the
        token axis: SDPA and its fused kernels), ``shape_only`` (reads only its input's shape
        or dtype: ``sym_size``, ``new_zeros``, ``zeros_like``), ``reduction`` (``global`` when
        it reduces the token axis), ``mixes_along_dim`` (refused along the token axis:
        ``softmax``, ``cumsum``, ``sort``), ``selects`` (``global`` when it takes part of the
        token axis), ``reshape`` (kept when the token order is), ``conv`` (patchify
        convolutions only), ``contracts`` (a matmul: refused over the token axis).
    price: how the cost model prices a node of the op: ``free`` (views, shape queries),
        ``convert`` (free when the dtype is kept, else memory), ``matrix`` (matmul FLOPs,
        tile-padded), ``attention`` (a flash-style kernel, :mod:`tppc.cost_models.attention`),
        ``vector`` (``flops_per_out`` per output element or ``flops_per_in`` per element of
        the first input; transcendentals count as several FLOPs), ``memory`` (bytes in and
        out only), ``create`` (bytes out only), ``lookup`` (an embedding: the gathered rows),
        ``grouped_matmul`` and ``routing`` (mixture-of-experts ops,
        :mod:`tppc.cost_models.moe`). ``None``: no rule; priced as memory traffic and
        reported as unpriced.
    aliases: the result shares its input's storage, so it allocates nothing
        (:mod:`tppc.cost_models.layer_memory`).

Keys are ATen ops by ``OpOverloadPacket`` (a rule holds for every overload). A target that
is no key is looked up by its short name: an in-place variant takes its op's rule
(``aten.add_`` → ``add``), a Python callable its namesake's (``F.scaled_dot_product_attention``
→ ``aten.scaled_dot_product_attention``), an op of another library its name's
(``transformers::grouped_mm_fallback``, registered only once transformers is imported).

Why in :mod:`tppc.ir`: the passes (floor ``passes``) and the cost model (floor
``cost_models``, above it) both read it, so it lives below both, with the rest of the
vocabulary they share (meta keys and records, ``torch.ops.tppc``). In the cost model the
passes could not import it (an upward import); in a pass the cost model would read a pass's
internals for a data table.

Example:
    >>> op_rule(torch.ops.aten.softmax.int)
    OpRule(role='mixes_along_dim', price='vector', flops_per_out=0, flops_per_in=5, aliases=False)
    >>> op_rule(torch.ops.aten.add_.Tensor).price, op_rule(torch.ops.aten.erfinv.default).price
    ('vector', None)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch.nn import functional as F

__all__ = ["OP_RULES", "OpRule", "Price", "Role", "op_rule", "ops_with"]

Role = Literal["row_wise", "attention", "shape_only", "reduction", "mixes_along_dim",
               "selects", "reshape", "conv", "contracts"]
Price = Literal["free", "convert", "matrix", "attention", "vector", "memory", "create",
                "lookup", "grouped_matmul", "routing"]


@dataclass(frozen=True)
class OpRule:
    """What tppc knows about one op (module docstring).

    Attributes:
        role: the annotation pass's rule for it.
        price: the cost model's rule for it (None: unpriced).
        flops_per_out: vector FLOPs per output element (``price="vector"``).
        flops_per_in: vector FLOPs per element of the first input (``price="vector"``).
        aliases: its result is a view of its input (allocates nothing).
    """

    role: Role = "row_wise"
    price: Price | None = None
    flops_per_out: int = 0
    flops_per_in: int = 0
    aliases: bool = False


def _short_name(target: object) -> str:
    """``aten.add_`` → ``"add_"``; a callable's ``__name__``; a string as it is."""
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _newer(name: str) -> object:
    """An ATen op some supported torch releases lack, keyed by its name where it is missing."""
    return getattr(torch.ops.aten, name, name)


_A = torch.ops.aten
_TABLE: dict[object, OpRule] = {
    # attention: SDPA and the fused kernels it decomposes to
    _A._scaled_dot_product_cudnn_attention: OpRule("attention", "attention"),
    _A._scaled_dot_product_efficient_attention: OpRule("attention", "attention"),
    _A._scaled_dot_product_flash_attention: OpRule("attention", "attention"),
    _A._scaled_dot_product_flash_attention_for_cpu: OpRule("attention", "attention"),
    _newer("_scaled_dot_product_attention_math_for_mps"): OpRule("attention", "attention"),
    _newer("_scaled_dot_product_fused_attention_overrideable"): OpRule("attention", "attention"),
    _A.scaled_dot_product_attention: OpRule("attention", "attention"),
    "softmax_attention": OpRule("attention", "attention"),  # tppc::, a folded eager region
    # matrix work
    _A._convolution: OpRule("conv", "matrix"),
    _A.addmm: OpRule(price="matrix"),
    _A.baddbmm: OpRule("contracts", "matrix"),
    _A.bmm: OpRule("contracts", "matrix"),
    _A.conv1d: OpRule("conv", "matrix"),
    _A.conv2d: OpRule("conv", "matrix"),
    _A.conv3d: OpRule("conv", "matrix"),
    _A.convolution: OpRule("conv", "matrix"),
    _A.einsum: OpRule("contracts", "matrix"),
    _A.linear: OpRule(price="matrix"),
    _A.matmul: OpRule("contracts", "matrix"),
    _A.mm: OpRule("contracts", "matrix"),
    # mixture of experts: grouped expert matmuls
    _newer("_grouped_mm"): OpRule(price="grouped_matmul"),
    "grouped_mm": OpRule(price="grouped_matmul"),
    "grouped_mm_fallback": OpRule(price="grouped_matmul"),
    # vector work
    _A.__and__: OpRule(price="vector", flops_per_out=1),
    _A.__or__: OpRule(price="vector", flops_per_out=1),
    _newer("_fused_rms_norm"): OpRule(price="vector", flops_per_in=4),
    _A._log_softmax: OpRule("mixes_along_dim", "vector", flops_per_in=6),
    _A._softmax: OpRule("mixes_along_dim", "vector", flops_per_in=5),
    _A.abs: OpRule(price="vector", flops_per_out=1),
    _A.add: OpRule(price="vector", flops_per_out=1),
    _A.all: OpRule("reduction", "vector", flops_per_in=1),
    _A.amax: OpRule("reduction", "vector", flops_per_in=1),
    _A.any: OpRule("reduction", "vector", flops_per_in=1),
    _A.amin: OpRule("reduction", "vector", flops_per_in=1),
    _A.argmax: OpRule("reduction", "vector", flops_per_in=1),
    _A.argmin: OpRule("reduction", "vector", flops_per_in=1),
    _A.batch_norm: OpRule(price="vector", flops_per_in=4),
    _A.bitwise_and: OpRule(price="vector", flops_per_out=1),
    _A.bitwise_not: OpRule(price="vector", flops_per_out=1),
    _A.bitwise_or: OpRule(price="vector", flops_per_out=1),
    _A.clamp: OpRule(price="vector", flops_per_out=1),
    _A.cos: OpRule(price="vector", flops_per_out=4),
    _A.cummax: OpRule("mixes_along_dim", "vector", flops_per_out=1),
    _A.cummin: OpRule("mixes_along_dim", "vector", flops_per_out=1),
    _A.cumprod: OpRule("mixes_along_dim", "vector", flops_per_out=1),
    _A.cumsum: OpRule("mixes_along_dim", "vector", flops_per_out=1),
    _A.diff: OpRule("mixes_along_dim", "vector", flops_per_out=1),
    _A.div: OpRule(price="vector", flops_per_out=1),
    _A.eq: OpRule(price="vector", flops_per_out=1),
    _A.isinf: OpRule(price="vector", flops_per_out=1),
    _A.isnan: OpRule(price="vector", flops_per_out=1),
    _A.erf: OpRule(price="vector", flops_per_out=4),
    _A.exp: OpRule(price="vector", flops_per_out=4),
    _A.floor_divide: OpRule(price="vector", flops_per_out=1),
    _A.ge: OpRule(price="vector", flops_per_out=1),
    _A.elu: OpRule(price="vector", flops_per_out=5),
    _A.gelu: OpRule(price="vector", flops_per_out=8),
    _A.group_norm: OpRule(price="vector", flops_per_in=8),
    _A.gt: OpRule(price="vector", flops_per_out=1),
    _A.hardtanh: OpRule(price="vector", flops_per_out=1),
    _A.layer_norm: OpRule(price="vector", flops_per_in=8),
    _A.le: OpRule(price="vector", flops_per_out=1),
    _A.log: OpRule(price="vector", flops_per_out=4),
    _A.logcumsumexp: OpRule("mixes_along_dim", "vector", flops_per_out=10),
    _A.log_softmax: OpRule("mixes_along_dim", "vector", flops_per_in=6),
    _A.logical_and: OpRule(price="vector", flops_per_out=1),
    _A.logical_not: OpRule(price="vector", flops_per_out=1),
    _A.lt: OpRule(price="vector", flops_per_out=1),
    _A.masked_fill: OpRule(price="vector", flops_per_out=1),
    _A.max: OpRule("reduction", "vector", flops_per_in=1),
    _A.maximum: OpRule(price="vector", flops_per_out=1),
    _A.mean: OpRule("reduction", "vector", flops_per_in=1),
    _A.min: OpRule("reduction", "vector", flops_per_in=1),
    _A.minimum: OpRule(price="vector", flops_per_out=1),
    _A.mish: OpRule(price="vector", flops_per_out=10),
    _A.mul: OpRule(price="vector", flops_per_out=1),
    _A.native_group_norm: OpRule(price="vector", flops_per_in=8),
    _A.native_layer_norm: OpRule(price="vector", flops_per_in=8),
    _A.ne: OpRule(price="vector", flops_per_out=1),
    _A.neg: OpRule(price="vector", flops_per_out=1),
    _A.pow: OpRule(price="vector", flops_per_out=2),
    _A.reciprocal: OpRule(price="vector", flops_per_out=4),
    _A.relu: OpRule(price="vector", flops_per_out=1),
    _A.remainder: OpRule(price="vector", flops_per_out=1),
    _A.rms_norm: OpRule(price="vector", flops_per_in=4),
    _A.rsqrt: OpRule(price="vector", flops_per_out=4),
    _A.rsub: OpRule(price="vector", flops_per_out=1),
    _A.sigmoid: OpRule(price="vector", flops_per_out=4),
    _A.silu: OpRule(price="vector", flops_per_out=5),
    _A.softplus: OpRule(price="vector", flops_per_out=6),
    _A.sin: OpRule(price="vector", flops_per_out=4),
    _A.softmax: OpRule("mixes_along_dim", "vector", flops_per_in=5),
    _A.sqrt: OpRule(price="vector", flops_per_out=4),
    _A.square: OpRule(price="vector", flops_per_out=1),
    _A.sub: OpRule(price="vector", flops_per_out=1),
    _A.sum: OpRule("reduction", "vector", flops_per_in=1),
    _A.tanh: OpRule(price="vector", flops_per_out=4),
    _A.var: OpRule("reduction", "vector", flops_per_in=3),
    _A.var_mean: OpRule("reduction", "vector", flops_per_in=3),
    _A.where: OpRule(price="vector", flops_per_out=1),
    # mixture of experts: routing
    _A.histc: OpRule(price="routing"),
    _A.sort: OpRule("mixes_along_dim", "routing"),
    _A.topk: OpRule("mixes_along_dim", "routing"),
    # gathers of rows
    _A.embedding: OpRule(price="lookup"),
    # memory traffic only
    _A._unsafe_index: OpRule(price="memory"),
    _A.cat: OpRule("selects", "memory"),
    _A.clone: OpRule(price="memory"),
    _A.concat: OpRule(price="memory"),
    _A.concatenate: OpRule(price="memory"),
    _A.constant_pad_nd: OpRule(price="memory"),
    _A.copy: OpRule(price="memory"),
    _A.fill: OpRule(price="memory"),
    _A.flip: OpRule("mixes_along_dim", "memory"),
    _A.gather: OpRule("mixes_along_dim", "memory"),
    _A.index: OpRule("selects", "memory"),
    _A.index_add: OpRule(price="memory"),
    _A.index_copy: OpRule(price="memory"),
    _A.index_put: OpRule(price="memory"),
    _A.index_select: OpRule("mixes_along_dim", "memory"),
    _A.masked_scatter: OpRule(price="memory"),
    _A.pad: OpRule(price="memory"),
    _A.repeat: OpRule(price="memory"),
    _A.repeat_interleave: OpRule(price="memory"),
    _A.roll: OpRule("mixes_along_dim", "memory"),
    _A.scatter: OpRule("mixes_along_dim", "memory"),
    _A.scatter_add: OpRule(price="memory"),
    _A.select_scatter: OpRule(price="memory"),
    _A.slice_scatter: OpRule(price="memory"),
    _A.stack: OpRule("selects", "memory"),
    _A.tril: OpRule(price="memory"),
    _A.triu: OpRule(price="memory"),
    _A.unfold: OpRule(price="memory"),
    # resampling reads neighbours along every spatial axis (VAE decoders)
    _A.upsample_bilinear2d: OpRule("mixes_along_dim", "vector", flops_per_out=4),
    _A.upsample_nearest2d: OpRule("mixes_along_dim", "memory"),
    _A.upsample_nearest3d: OpRule("mixes_along_dim", "memory"),
    _A.upsample_trilinear3d: OpRule("mixes_along_dim", "vector", flops_per_out=8),
    _A.zero: OpRule(price="memory"),
    # creation: writes only
    _A.arange: OpRule(price="create"),
    _A.empty: OpRule(price="create"),
    _A.empty_like: OpRule("shape_only", "create"),
    _A.full: OpRule(price="create"),
    _A.full_like: OpRule("shape_only", "create"),
    _A.new_empty: OpRule("shape_only", "create"),
    _A.new_full: OpRule("shape_only", "create"),
    _A.new_ones: OpRule("shape_only", "create"),
    _A.new_zeros: OpRule("shape_only", "create"),
    _A.ones: OpRule(price="create"),
    _A.ones_like: OpRule("shape_only", "create"),
    _A.rand: OpRule(price="create"),
    _A.randn: OpRule(price="create"),
    _A.scalar_tensor: OpRule(price="create"),
    _A.zeros: OpRule(price="create"),
    _A.zeros_like: OpRule("shape_only", "create"),
    # dtype conversions
    _A._to_copy: OpRule(price="convert"),
    _A.contiguous: OpRule(price="convert", aliases=True),
    _A.to: OpRule(price="convert"),
    _A.type_as: OpRule(price="convert"),
    # views and shape queries: free
    _A._assert_async: OpRule(price="free"),
    _A._assert_tensor_metadata: OpRule("shape_only", "free"),
    _A._reshape_alias: OpRule(price="free"),
    _A._unsafe_view: OpRule("reshape", "free", aliases=True),
    _A.alias: OpRule(price="free", aliases=True),
    _A.as_strided: OpRule(price="free", aliases=True),
    _A.chunk: OpRule("selects", "free", aliases=True),
    _A.detach: OpRule(price="free", aliases=True),
    _A.dropout: OpRule(price="free"),
    _A.expand: OpRule(price="free", aliases=True),
    _A.expand_as: OpRule(price="free"),
    _A.flatten: OpRule("reshape", "free", aliases=True),
    operator.getitem: OpRule(price="free", aliases=True),
    _A.lift_fresh_copy: OpRule(price="free"),
    _A.movedim: OpRule(price="free"),
    _A.narrow: OpRule("selects", "free", aliases=True),
    _A.permute: OpRule(price="free", aliases=True),
    _A.reshape: OpRule("reshape", "free", aliases=True),
    _A.select: OpRule("selects", "free", aliases=True),
    _A.slice: OpRule("selects", "free", aliases=True),
    _A.split: OpRule("selects", "free", aliases=True),
    _A.split_with_sizes: OpRule("selects", "free", aliases=True),
    _A.squeeze: OpRule(price="free", aliases=True),
    _A.sym_constrain_range_for_size: OpRule(price="free"),
    _A.sym_numel: OpRule("shape_only", "free"),
    _A.sym_size: OpRule("shape_only", "free"),
    _A.sym_stride: OpRule(price="free"),
    _A.t: OpRule(price="free", aliases=True),
    _A.transpose: OpRule(price="free", aliases=True),
    _A.unbind: OpRule("selects", "free", aliases=True),
    _A.unflatten: OpRule("reshape", "free", aliases=True),
    _A.unsqueeze: OpRule(price="free", aliases=True),
    _A.view: OpRule("reshape", "free", aliases=True),
    _A.view_as: OpRule("reshape", "free"),
    # annotation rules of ops the cost model does not price
    _A.glu: OpRule("mixes_along_dim"),
    _A.kthvalue: OpRule("mixes_along_dim"),
    _A.linalg_vector_norm: OpRule("reduction"),
    _A.logsumexp: OpRule("reduction"),
    _A.median: OpRule("mixes_along_dim"),
    _A.mode: OpRule("mixes_along_dim"),
    _A.norm: OpRule("reduction"),
    _A.prod: OpRule("reduction"),
    _A.reshape_as: OpRule("reshape"),
    F.softmin: OpRule("mixes_along_dim"),
    _A.std: OpRule("reduction"),
    _A.std_mean: OpRule("reduction"),
    _A.tensor_split: OpRule("selects"),
    _A.unsafe_split: OpRule("selects"),
    _A.view_as_complex: OpRule(aliases=True),
    _A.view_as_real: OpRule(aliases=True),
}
OP_RULES: Mapping[object, OpRule] = MappingProxyType(_TABLE)
"""The table: ATen ``OpOverloadPacket`` (or a Python callable, or a short name) → rule."""
_BY_NAME: dict[str, OpRule] = {_short_name(key): rule for key, rule in _TABLE.items()}
_UNKNOWN = OpRule()


def op_rule(target: object) -> OpRule:
    """The rule of an fx node's target; ``OpRule()`` (row-wise, unpriced) for an unknown op."""
    packet = getattr(target, "overloadpacket", target)
    rule = _TABLE.get(packet)
    if rule is not None:
        return rule
    name = _short_name(packet)
    rule = _BY_NAME.get(name)
    if rule is None and name.endswith("_") and not name.startswith("__"):
        rule = _BY_NAME.get(name.rstrip("_"))  # an in-place variant
    return rule or _UNKNOWN


def ops_with(predicate: Callable[[OpRule], bool]) -> frozenset[object]:
    """The table's keys whose rule satisfies ``predicate``, e.g. every attention op."""
    return frozenset(key for key, rule in _TABLE.items() if predicate(rule))
