"""Models without weights, safetensors checkpoints, and loading only one stage's tensors.

Terms:
    empty model: the model built with every parameter on the meta device (no storage) while
        its buffers are computed for real (rotary ``inv_freq`` and the like are small, and HF
        checkpoints do not ship the non-persistent ones). :func:`empty_model` builds one from
        a factory; capture and planning run on it.
    checkpoint: a safetensors file of the model's ``state_dict`` (the format HF checkpoints
        ship in). A tied weight is stored once, under its first name
        (:func:`save_checkpoint`); the loader finds it under any of its names.
    stage weights: the tensors one stage graph reads (``get_attr`` paths, which keep the
        model's fully qualified names), read from the checkpoint one by one onto the stage's
        device (:class:`StageWeights`); a rank never holds the other stages' weights.
    shard weights: a worker of a tensor-parallel stage reads parts of tensors
        (:class:`tppc.passes.sharding.shard_graph.PartOf`): only the part's rows of each
        segment are read from the checkpoint (``safe_open(...).get_slice``), never the
        whole tensor; from a real model they are sliced off and copied.

Example:
    >>> model, args, kwargs, buffers = empty_model(tppc.examples.hf_llama)   # doctest: +SKIP
    >>> weights = StageWeights("llama.safetensors", model, buffers, torch.device("cpu"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.passes.sharding.shard_graph import PartOf, take

__all__ = ["StageWeights", "empty_model", "save_checkpoint"]

_POSITIONAL_PREFIX = "tppc_positional."
"""Stage graphs hold their positional program as this submodule (same tensor names below)."""


def save_checkpoint(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model.state_dict()`` to a safetensors file, each tied tensor once.

    Returns:
        The path written.
    """
    from safetensors.torch import save_file

    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:  # a tied weight (lm_head = embeddings): stored under the first name
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(path), metadata={"format": "pt", "writer": "tppc"})
    return Path(path)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block moves to the meta device at once."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: Any) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            meta = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            self._parameters[name] = meta

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_model(factory: Callable[..., Any], *fargs: Any, **fkwargs: Any
                ) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any],
                           dict[str, torch.Tensor]]:
    """Build ``factory(*fargs, **fkwargs)`` with its parameters on the meta device.

    The factory returns ``(model, example_args, example_kwargs)`` (see
    :mod:`tppc.examples`). Parameters are created and moved to meta one at a time (never the
    whole model in memory); buffers are computed for real, kept aside, and moved to meta so
    that the returned model is entirely on meta.

    Returns:
        ``(model, example_args, example_kwargs, buffers)``: buffers by fully qualified name.
    """
    with _parameters_on_meta():
        model, args, kwargs = factory(*fargs, **fkwargs)
    buffers: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules():
        for name, buf in list(mod._buffers.items()):
            if buf is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            if buf.device.type != "meta":
                buffers[full] = buf
            mod._buffers[name] = buf.to("meta")
    return model, tuple(args), dict(kwargs), buffers


class StageWeights:
    """Loads the tensors of stage graphs from a checkpoint onto one device, each once.

    Args:
        checkpoint: a safetensors file, or None to copy from ``model`` (which then must hold
            real tensors: every rank holds the whole model).
        model: the model (empty or not): its tied names resolve aliases.
        buffers: real buffers by name (from :func:`empty_model`), used when the checkpoint
            lacks them (non-persistent buffers).
        device: where the tensors go.
    """

    def __init__(self, checkpoint: str | Path | None, model: torch.nn.Module,
                 buffers: dict[str, torch.Tensor], device: torch.device) -> None:
        self.checkpoint, self.device = checkpoint, device
        self._model, self._buffers = model, buffers
        self._loaded: dict[str, torch.Tensor] = {}
        self._aliases = _tied_names(model)
        self._keys: set[str] = set()
        if checkpoint is not None:
            from safetensors import safe_open

            if not Path(checkpoint).is_file():
                raise SpecError(f"checkpoint={str(checkpoint)!r} is not a file. fix: write one "
                                "with tppc.distributed.checkpoint.save_checkpoint(model, path)")
            with safe_open(str(checkpoint), framework="pt") as f:
                self._keys = set(f.keys())

    @property
    def nbytes(self) -> int:
        """Bytes loaded so far."""
        return sum(t.numel() * t.element_size() for t in self._loaded.values())

    def materialise(self, *modules: fx.GraphModule,
                    parts: Mapping[str, PartOf] | None = None) -> None:
        """Replace every parameter and buffer of ``modules`` by its loaded tensor; an
        attribute named in ``parts`` (a shard's) by its part of the source tensor."""
        parts = parts or {}
        for module in modules:
            for prefix, sub in module.named_modules():
                for table in (sub._parameters, sub._buffers):
                    for name in list(table):
                        full = f"{prefix}.{name}" if prefix else name
                        tensor = self.tensor(full, parts.get(full))
                        table[name] = (torch.nn.Parameter(tensor, requires_grad=False)
                                       if table is sub._parameters else tensor)

    def tensor(self, name: str, part: PartOf | None = None) -> torch.Tensor:
        """The tensor named ``name`` (a stage graph path) on the device, loaded once; with
        ``part``, that part of its source tensor (only the part is read)."""
        while name.startswith(_POSITIONAL_PREFIX):
            name = name[len(_POSITIONAL_PREFIX):]
        if name not in self._loaded:
            self._loaded[name] = self._read(name) if part is None else self._read_part(part)
        return self._loaded[name]

    def _read_part(self, part: PartOf) -> torch.Tensor:
        """Part ``part.rank`` of ``part.degree`` of tensor ``part.target`` (see
        :func:`tppc.passes.sharding.shard_graph.take`)."""
        candidates = [part.target, *self._aliases.get(part.target, ())]
        found = next((c for c in candidates if c in self._keys), None)
        if self.checkpoint is None or found is None:
            whole = self._read(part.target)  # a real model's tensor, or a buffer
            return take(whole, part.axis, part.segments, part.rank, part.degree)
        from safetensors import safe_open

        with safe_open(str(self.checkpoint), framework="pt", device="cpu") as f:
            view = f.get_slice(found)
            rank = len(view.get_shape())
            pieces, off = [], 0
            for size in part.segments:
                step = size // part.degree
                start = off + part.rank * step
                index = (slice(None),) * part.axis + (slice(start, start + step),)
                pieces.append(view[index + (slice(None),) * (rank - part.axis - 1)])
                off += size
        got = pieces[0] if len(pieces) == 1 else torch.cat(pieces, part.axis)
        return got.contiguous().to(self.device)

    def _read(self, name: str) -> torch.Tensor:
        candidates = [name, *self._aliases.get(name, ())]
        if self.checkpoint is not None:
            from safetensors import safe_open

            found = next((c for c in candidates if c in self._keys), None)
            if found is not None:
                with safe_open(str(self.checkpoint), framework="pt", device="cpu") as f:
                    return f.get_tensor(found).to(self.device)
            if name in self._buffers:
                return self._buffers[name].to(self.device)
            raise SpecError(
                f"tensor {name!r} (also known as {candidates[1:]}) is not in checkpoint "
                f"{str(self.checkpoint)!r} ({len(self._keys)} tensors). fix: write the "
                "checkpoint from this model's state_dict (tppc.distributed.checkpoint."
                "save_checkpoint)")
        tensor = _lookup(self._model, name)
        if tensor.device.type == "meta":
            raise SpecError(f"tensor {name!r} of the model is on the meta device and no "
                            "checkpoint was given. fix: pass checkpoint='model.safetensors'")
        return tensor.detach().to(self.device)


def _tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter's other names (tied weights share one Parameter object)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n: tuple(o for o in group if o != n) for group in names.values() for n in group
            if len(group) > 1}


def _lookup(model: torch.nn.Module, name: str) -> torch.Tensor:
    module_path, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(module_path) if module_path else model
        return getattr(owner, leaf)
    except AttributeError as exc:
        raise SpecError(f"the model has no tensor {name!r}") from exc
