"""A diffusers transformer that runs as a PipeFusion pipeline inside the pipeline's own loop.

Terms:
    drop-in: :class:`PipeFusionTransformer` set as ``pipe.transformer``; the pipeline call
        (``pipe(prompt, num_inference_steps=...)``) runs unchanged. What pipelines read of
        their transformer is answered by the wrapped model (``config``, ``dtype``,
        ``device``, any other attribute), ``forward`` takes the model's arguments and
        ``return_dict``, and ``cache_context(name, **where)`` names the stream of the calls inside it
        (:mod:`tppc.pipefusion.step`).
    lazy compile: the first call compiles the model with that call's inputs
        (``return_dict=False``), so the pipeline's dtypes, text length and latent size are
        the example; a call whose tensors have other dtypes compiles once more; other batch
        sizes (classifier-free guidance) are captured by the compiled pipeline.
    loop: one pipeline call. :func:`compile_pipeline` starts a new one whenever the pipeline
        opens its progress bar (every diffusers pipeline does, once, before its loop);
        :meth:`PipeFusionTransformer.reset` starts one by hand.

With ``warmup_steps=None`` every call is warm and the pipeline call equals the eager one
(to round-off); after the warm-up calls the patches flow through the stages with
one-step-stale K/V, the pipeline filling and draining once per step (the loop steps the
latent between calls): ``M + S − 1`` patch times per step for ``M`` patches on ``S``
stages, where ``cp.denoise`` overlaps the steps (``M`` per step); the fill and the drain
borrow the waiting stages' intra-op threads.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tppc.dispatch.compile import compile_pipeline as compile_model
from tppc.pipefusion.step import StepCalls
from tppc.pipeline.compiled import CompiledPipeline

__all__ = ["PipeFusionTransformer", "compile_pipeline"]


class PipeFusionTransformer(torch.nn.Module):
    """``model`` (a diffusers transformer) run by PipeFusion, called like ``model``.

    Args:
        model: the diffusers transformer (kept as ``self.model``; its stages alias its
            weights).
        warmup_steps: warm calls per loop (``None``: every call: exact).
        patches: patches of a stale call (``None``: the diffusion plan's).
        **options: :func:`tppc.compile` options (``num_stages``, ``executor``, ...).

    Attributes:
        compiled: the compiled pipelines, by the dtypes of the call's tensors.
    """

    def __init__(self, model: torch.nn.Module, *, warmup_steps: int | None = 1,
                 patches: int | None = None, **options: Any) -> None:
        super().__init__()
        self.model = model
        self.warmup_steps, self.patches, self.options = warmup_steps, patches, options
        self.compiled: dict[Any, Any] = {}
        self._calls: dict[Any, StepCalls] = {}
        self._stream: Any = None
        self._steps: int | None = None
        self._return_dict = "return_dict" in inspect.signature(model.forward).parameters

    @property
    def config(self) -> Any:
        """The wrapped model's config (pipelines read ``sample_size``, ``in_channels``...)."""
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped model's dtype."""
        return getattr(self.model, "dtype", next(self.model.parameters()).dtype)

    @property
    def device(self) -> torch.device:
        """The wrapped model's device (``pipe._execution_device`` reads it)."""
        return getattr(self.model, "device", next(self.model.parameters()).device)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(super().__getattr__("model"), name)

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """The calls inside are the stream ``name`` (its own K/V and step count); ``kwargs``
        (diffusers 0.42: ``step_index``, ``sigma``, ``num_inference_steps``) go to the
        model's own ``cache_context`` (the stream counts its steps itself)."""
        inner = getattr(self.model, "cache_context", None)
        before, self._stream = self._stream, name
        try:
            with inner(name, **kwargs) if inner is not None else contextlib.nullcontext():
                yield
        finally:
            self._stream = before

    def reset(self, num_inference_steps: int | None = None) -> None:
        """Start a new loop of ``num_inference_steps`` steps (module docstring)."""
        self._steps = num_inference_steps
        for calls in self._calls.values():
            calls.reset()
            calls.num_inference_steps = num_inference_steps

    def forward(self, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        """One step's call of the model, through the stages; returns what the model returns
        (``return_dict=True``: a ``Transformer2DModelOutput``)."""
        if self._return_dict:
            kwargs["return_dict"] = False
        key = tuple(str(leaf.dtype) for leaf in pytree.tree_leaves((args, kwargs))
                    if isinstance(leaf, torch.Tensor))
        calls = self._calls.get(key)
        if calls is None:
            cp = compile_model(self.model, tuple(args), kwargs, **self.options)
            self.compiled[key] = cp
            calls = self._calls[key] = _step_calls(cp)(cp, warmup_steps=self.warmup_steps,
                                                       patches=self.patches,
                                                       num_inference_steps=self._steps)
        out = calls(args, kwargs, stream=self._stream)
        if not return_dict:
            return out
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out[0] if isinstance(out, tuple | list) else out)


def _step_calls(cp: Any) -> type[StepCalls]:
    """How ``cp`` runs one step's call: in this process, or through its job (a rank of
    ``backend="distributed"``: every rank calls, the outputs reach every rank)."""
    from tppc.distributed.pipeline import DistributedPipeline

    if isinstance(cp, DistributedPipeline):
        from tppc.distributed.step_calls import DistributedStepCalls

        return DistributedStepCalls
    return StepCalls


def compile_pipeline(pipe: Any, *, warmup_steps: int | None = 1, patches: int | None = None,
                     **options: Any) -> Any:
    """Set ``pipe.transformer`` to a :class:`PipeFusionTransformer` of it and start a new
    loop at every pipeline call; returns ``pipe`` (its call is unchanged;
    ``pipe.save_pretrained`` saves the original transformer). A ``pipe.transformer`` that is
    already compiled (a :class:`PipeFusionTransformer`, or ``tppc.compile``'s result) is
    replaced by one of its model.

    Example:
        >>> pipe = tppc.diffusers.compile_pipeline(pipe, warmup_steps=1, patches=4,
        ...                                        num_stages=2)         # doctest: +SKIP
        >>> image = pipe(prompt, num_inference_steps=20).images[0]

    With ``backend="distributed"`` (on every rank of a torchrun job or ``tppc.launch``, the
    same script building the same pipeline) the transformer runs as ranks, one per worker of
    the plan (:mod:`tppc.distributed.step_calls`); every rank's pipeline call returns the
    images.
    """
    model = pipe.transformer
    if isinstance(model, PipeFusionTransformer | CompiledPipeline):  # compiled before
        model = model.model
    adapter = PipeFusionTransformer(model, warmup_steps=warmup_steps, patches=patches,
                                    **options)
    pipe.transformer = adapter
    bar = type(pipe).progress_bar.__get__(pipe)

    def progress_bar(iterable: Any = None, total: int | None = None) -> Any:
        steps = total if total is not None else (len(iterable) if hasattr(iterable, "__len__")
                                                 else None)
        current = pipe.transformer  # the one the pipeline calls now
        if isinstance(current, PipeFusionTransformer):
            current.reset(steps)
        return bar(iterable=iterable, total=total)

    pipe.progress_bar = progress_bar
    pipe.save_pretrained = _saving_the_model(pipe)
    return pipe


def _saving_the_model(pipe: Any) -> Any:
    """``pipe.save_pretrained`` that saves the wrapped model where the pipeline holds a
    :class:`PipeFusionTransformer` (diffusers saves only its own classes, and would drop it):
    the saved pipeline loads back as a plain diffusers pipeline."""
    save = type(pipe).save_pretrained.__get__(pipe)

    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        current = pipe.transformer
        if not isinstance(current, PipeFusionTransformer):
            return save(*args, **kwargs)
        pipe.transformer = current.model  # the pipeline registers the model's class
        try:
            return save(*args, **kwargs)
        finally:
            pipe.transformer = current

    return save_pretrained
