"""The chunk step of one attention node: K/V written to and read from the buffers, the mask.

A mixin of the chunk-attention rewriter (:mod:`.chunk_attention`, whose module docstring
describes the buffers): :meth:`AttentionStep._attention` reads keys ``[0, kv_len)`` back
(``kv_len`` = ``chunk_start + chunk_size`` for causal attention, the whole length
otherwise; DiT rows and text segments in units of their rows), re-applies grouped-query
repetition or calls SDPA with ``enable_gqa``, and either keeps SDPA with the mask's key
columns narrowed (``is_causal`` → an offset-causal mask) or calls ``tppc::chunk_attention``
with the chunk's bias rows, joint mask rows, key mask, key validity, window, soft-cap, sinks
or blocks (:meth:`AttentionStep._chunk_op`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.records import CHUNK_INPUT, TOKEN, ChunkInput, TokenInfo
from tppc.passes.annotation.attention import chunked_kernel
from tppc.passes.chunking.chunk_parts import cache_source, is_head_repeat, sdpa_kwargs
from tppc.passes.chunking.context_rows import check_context
from tppc.passes.chunking.token_rows import row_offset
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["AttentionStep"]

_aten = torch.ops.aten


class AttentionStep:
    """Rewrites an attention node for one chunk (a mixin: the rewriter supplies the graph,
    ``env``, ``buffer_nodes``, ``start``, ``size``, ``seq_len``, ``bias`` and the helpers
    ``_read_buffer``, ``_kv_end``, ``_new``, ``_scale``, ``_frames``, ``_full_input``)."""

    def _attention(self, node: fx.Node) -> fx.Node:
        kwargs = sdpa_kwargs(node)
        layer = node  # new nodes take its layer and part
        info: TokenInfo = node.meta[TOKEN]
        causal = info.attention == "causal"
        kv_len = self._kv_end() if causal else self.seq_len
        keys: ChunkInput = self.buffer_nodes[node.name, "key"].meta[CHUNK_INPUT]
        check_context(node, "attention", keys.suffix)
        if (keys.scale, keys.prefix, keys.suffix) != (1, 0, 0):  # DiT rows, text segments
            end = self._kv_end() if causal else self.seq_len
            kv_len = row_offset(self.graph, end, keys.scale, keys.prefix + keys.suffix)
        bias = info.mask is not None and info.mask.bias  # K/V heads repeated: per-head rows
        gqa = not bias and chunked_kernel(node) and all(
            is_head_repeat(*cache_source(kwargs[w], self.sym)) for w in ("key", "value"))
        for which in ("key", "value"):
            buf = self.buffer_nodes[node.name, which]
            axis = buf.meta[CHUNK_INPUT].axis
            kwargs[which] = self._read_buffer(kwargs[which], buf, axis, kv_len, layer,
                                              repeat=not gqa, frames=self._frames(info))
        if chunked_kernel(node):
            return self._chunk_op(node, kwargs, causal, gqa or kwargs.get("enable_gqa", False),
                                  kv_len)
        if gqa:
            kwargs["enable_gqa"] = True
        mask = kwargs.get("attn_mask")
        if kwargs.get("is_causal"):
            ones = self._new(_aten.new_ones.default, (self.env[kwargs["query"]],
                             [self.size, kv_len]), layer, {"dtype": torch.bool})
            kwargs["attn_mask"] = self._new(_aten.tril.default, (ones, self.start), layer)
            kwargs["is_causal"] = False
        elif isinstance(mask, fx.Node):
            val = tensor_val(mask)
            new_mask = self.env[mask]
            if val is not None and self.sym in size_expr(val.shape[-1]).free_symbols:
                new_mask = self._new(_aten.narrow.default, (new_mask, -1, 0, kv_len), layer)
            kwargs["attn_mask"] = new_mask
        kwargs = {k: (self.env[v] if isinstance(v, fx.Node) and k not in ("key", "value",
                                                                          "attn_mask") else v)
                  for k, v in kwargs.items()}
        out = self.graph.call_function(node.target, (), kwargs)
        out.meta.update(node.meta)
        return out

    def _chunk_op(self, node: fx.Node, kwargs: dict[str, Any], causal: bool,
                  gqa: bool, kv_len: Any) -> fx.Node:
        """``tppc::chunk_attention`` over the buffer: annotation proved the mask causal or
        all-visible at every probe length, so it is dropped (nothing ``L × L`` remains); a
        float bias becomes its rows for the chunk (its hidden keys included)."""
        if kwargs.get("dropout_p", 0.0):
            raise PassError(f"attention node {node.name!r} has dropout_p="
                            f"{kwargs['dropout_p']}; fix: put the model in eval mode")
        start, scale = self.start, self._scale(node.meta[TOKEN])
        if causal and self.ctx.block_size is not None and scale != 1:  # rows of k tokens
            start = row_offset(self.graph, start, scale, 0)  # the query's first token
        args = (self.env[kwargs["query"]], kwargs["key"], kwargs["value"], start, causal,
                kwargs.get("scale"), bool(gqa))
        mask = node.meta[TOKEN].mask
        if mask is not None and mask.bias:
            args = (*args, self.bias.rows(kwargs["attn_mask"], node, kv_len if causal else None))
        elif mask is not None and mask.query_rows:  # over [text | tokens]: the chunk's rows
            args = (*args, self.bias.joint_rows(kwargs["attn_mask"], node, self.carry))
        elif mask is not None and mask.key_mask:  # one row over the keys, whole
            args = (*args, self.bias.whole(kwargs["attn_mask"]))
        elif mask is not None:
            valid = None if mask.key_valid is None else self._full_input(mask.key_valid)
            args = (*args, None, valid, mask.window)
        extra = (kwargs.get("softcap"), kwargs.get("sinks"))  # tppc::softmax_attention's
        if extra != (None, None):
            args = (*args, *[None] * (10 - len(args)), extra[0],
                    self.env[extra[1]] if isinstance(extra[1], fx.Node) else extra[1])
        if mask is not None and mask.block is not None:  # chunked attention's blocks
            args = (*args, *[None] * (12 - len(args)), mask.block)
        out = self.graph.call_function(torch.ops.tppc.chunk_attention.default, args)
        out.meta.update(node.meta)
        return out
