"""Op tables of the cost model: which ATen ops are views, matmuls, attention, vector work.

Names are the short op names of :func:`tppc.cost_models.node_costs._op_name` (``aten.add_``
is ``add``). Vector FLOP weights are rough: a transcendental counts as several FLOPs.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["ATTENTION", "CONVERT", "CREATE", "DTYPE_NAMES", "MATMUL", "MEMORY", "PER_IN",
           "PER_OUT", "VIEW", "UnpricedOpWarning", "warn_unpriced"]

VIEW = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "expand_as", "transpose",
    "permute", "unsqueeze", "squeeze", "slice", "select", "alias", "t", "as_strided", "detach",
    "unbind", "split", "split_with_sizes", "chunk", "narrow", "flatten", "unflatten", "view_as",
    "dropout", "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "getitem",
    "lift_fresh_copy", "movedim", "_assert_async", "sym_constrain_range_for_size",
})
CONVERT = frozenset({"to", "_to_copy", "type_as", "contiguous", "clone"})
MATMUL = frozenset({"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "einsum",
                    "conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
ATTENTION = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
})
# Vector FLOPs per output element (transcendentals count as several FLOPs).
PER_OUT = {
    **dict.fromkeys(("add", "sub", "mul", "div", "neg", "rsub", "where", "clamp", "maximum",
                     "minimum", "abs", "relu", "eq", "ne", "lt", "le", "gt", "ge",
                     "masked_fill", "__and__", "__or__", "bitwise_and", "bitwise_or",
                     "logical_and", "logical_not", "square", "cumsum", "remainder",
                     "floor_divide", "hardtanh"), 1),
    **dict.fromkeys(("exp", "log", "rsqrt", "sqrt", "sigmoid", "tanh", "sin", "cos",
                     "reciprocal", "erf"), 4),
    "pow": 2,
    "diff": 1, "silu": 5, "gelu": 8, "mish": 10,
}
# Vector FLOPs per element of the first input.
PER_IN = {"sum": 1, "mean": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "argmax": 1, "argmin": 1,
          "var": 3,
          "var_mean": 3, "_softmax": 5, "softmax": 5, "_log_softmax": 6, "log_softmax": 6,
          "layer_norm": 8, "native_layer_norm": 8, "group_norm": 8, "native_group_norm": 8,
          "rms_norm": 4, "_fused_rms_norm": 4, "batch_norm": 4}
# Ops that only move memory (priced as bytes in and out, no arithmetic).
MEMORY = frozenset({"cat", "concat", "concatenate", "stack", "copy", "clone", "_to_copy", "to",
                    "contiguous", "index", "index_select", "gather", "scatter", "scatter_add",
                    "index_put", "index_copy", "index_add", "constant_pad_nd", "pad", "repeat",
                    "repeat_interleave", "roll", "flip", "tril", "triu", "fill", "zero",
                    "masked_scatter", "slice_scatter", "select_scatter", "embedding",
                    "type_as", "lift_fresh_copy", "_unsafe_index", "unfold"})
CREATE = frozenset({"zeros", "ones", "full", "empty", "arange", "zeros_like", "ones_like",
                    "full_like", "empty_like", "new_ones", "new_zeros", "new_full",
                    "new_empty", "scalar_tensor", "rand", "randn"})
DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp32", torch.bfloat16: "bf16",
               torch.float16: "fp16", torch.int8: "int8", torch.uint8: "int8"}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = "fp8"


class UnpricedOpWarning(UserWarning):
    """An op has no pricing rule; it was priced as memory traffic only."""


_WARNED: set[str] = set()


def warn_unpriced(op: str, node_name: str) -> None:
    """Warn (once per op name in this process) that ``op`` has no pricing rule."""
    if op in _WARNED:
        return
    _WARNED.add(op)
    warnings.warn(
        f"tppc cost model: no pricing rule for op {op!r} (first seen at node {node_name}); "
        "priced as memory traffic only (its FLOPs count as 0). Add it to the tables in "
        "tppc/cost_models/op_tables.py if it does real arithmetic.",
        UnpricedOpWarning, stacklevel=4)
