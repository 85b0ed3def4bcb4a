"""Positional tables kept at a configured sample size, fitted to the captured latent.

Terms:
    sample table: a positional table a module builds at its config's sample size and keeps
        as a buffer (``pos_embedding``), and rebuilds in ``forward`` for any other size
        through ``tensor.data[...].copy_`` — an alias torch.export does not trace, so the
        rebuilt table stays a fake constant and the capture fails. diffusers' CogVideoX
        patch embedding (``sample_height``, ``sample_width``, ``sample_frames``,
        ``temporal_compression_ratio``, ``_get_positional_embeddings``) is one.
    fitting: before the export, the traced module tree (the shadow of
        :mod:`tppc.frontend.isolation`, never the user's model) gets the table of the
        latent's own size and that size as its sample size, built eagerly by the module's
        own method: what ``from_pretrained(..., sample_height=h, sample_width=w)`` builds,
        and what the module's ``forward`` computes at that size, so the capture equals the
        model. The capture is specialised to the size (as at the sample size); another size
        is captured again.

Example:
    >>> fit_sample_tables(shadow, bound)      # doctest: +SKIP
    >>> shadow.patch_embed.sample_height, model.patch_embed.sample_height
    (12, 8)
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["fit_sample_tables"]

_INTERFACE = ("sample_height", "sample_width", "sample_frames", "temporal_compression_ratio",
              "_get_positional_embeddings")
"""What a module with a sample table has (module docstring)."""


def fit_sample_tables(traced: torch.nn.Module, bound: inspect.BoundArguments) -> None:
    """Give every module of ``traced`` with a sample table the table of the call's video
    latent ``(batch, frames, channels, height, width)`` (the first 5-D floating input)."""
    latent = next((v for v in bound.arguments.values() if isinstance(v, torch.Tensor)
                   and v.dim() == 5 and v.is_floating_point()), None)
    if latent is None:
        return
    frames, height, width = (int(latent.shape[i]) for i in (1, 3, 4))
    for module in traced.modules():
        table = module.__dict__.get("_buffers", {}).get("pos_embedding")
        if table is None or not all(hasattr(module, a) for a in _INTERFACE) \
                or getattr(module, "use_learned_positional_embeddings", False):
            continue
        size = (height, width, (frames - 1) * module.temporal_compression_ratio + 1)
        if size == (module.sample_height, module.sample_width, module.sample_frames):
            continue
        fitted = module._get_positional_embeddings(*size)
        module._buffers["pos_embedding"] = fitted.to(device=table.device, dtype=table.dtype)
        module.__dict__.update(sample_height=size[0], sample_width=size[1],
                               sample_frames=size[2])
