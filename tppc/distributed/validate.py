"""Translation validation of a distributed compile: rank 0 checks the program, every rank obeys.

Terms:
    check on rank 0: after the plan is shared and before any rank loads its stage, rank 0
        runs the check ``tppc.compile`` runs (:func:`tppc.validation.validate.validate_pipeline`:
        the emitted stages, two of them at least, in two or three chunks, against the unsplit
        captured graph; a long example at two short lengths) on a local program with every
        stage on its own device. The weights of that check come from where the ranks' come
        from: the model's own tensors, or the checkpoint (read into copies of the captured
        graphs, freed when the check ends: rank 0 holds the whole model meanwhile).
    verdict: rank 0 broadcasts the check's runs, or its error; every rank returns the same
        :class:`tppc.validation.validate.Validation` or raises :class:`tppc.errors.SoundnessError`
        (rank 0 its own, naming the node; the others quote it). The other ranks wait for it
        like they wait for the plan (``comm_timeout``).

``verify=False`` (on every rank: the options are the job's) skips the check and the broadcast.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from tppc.backends import wire
from tppc.distributed.checkpoint import StageWeights
from tppc.driver.emit import Emitter
from tppc.driver.options import CompileOptions
from tppc.errors import SoundnessError, StageFailed
from tppc.frontend.front_end import FrontEnd
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.pipeline.compiled import CompiledPipeline
from tppc.planner.plan import Plan
from tppc.validation.validate import CheckRun, Validation, validate_pipeline

__all__ = ["retarget", "validate_on_rank0"]


def validate_on_rank0(model: torch.nn.Module, front: FrontEnd, plan: Plan,
                      options: CompileOptions, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any] | None, *, checkpoint: str | None,
                      buffers: Mapping[str, torch.Tensor], device: torch.device, rank: int
                      ) -> Validation:
    """The verdict of rank 0's check on every rank (collective; see the module docstring).

    Args:
        model: the model (real, or empty with ``checkpoint``).
        front: the job's capture.
        plan: the job's plan.
        options: the job's options.
        args: the example's positional inputs.
        kwargs: its keyword inputs.
        checkpoint: the safetensors file of the weights, or None (the model's own).
        buffers: real buffers of an empty model.
        device: rank 0's device.
        rank: this rank.

    Raises:
        SoundnessError: rank 0's check found a difference (on every rank).
        StageFailed: rank 0 did not share its verdict in time.
    """
    box: Any = None
    error: SoundnessError | None = None
    if rank == 0:
        try:
            loader = StageWeights(checkpoint, model, dict(buffers), device)
            validation = _check_locally(model, front, plan, options, args, kwargs or {},
                                        loader)
            box = {"runs": [list(dataclasses.astuple(r)) for r in validation.runs],
                   "seconds": validation.seconds, "notes": list(validation.notes)}
        except SoundnessError as exc:
            error, box = exc, {"error": str(exc)}
    try:
        box = wire.broadcast(box, 0)
    except Exception as exc:
        raise StageFailed(f"rank 0 did not share the validation verdict: {exc}. fix: see rank "
                          "0's log, raise comm_timeout, or compile with verify=False") from exc
    if "error" in box:
        if error is not None:
            raise error
        raise SoundnessError(f"rank 0's translation validation refused the program: "
                             f"{box['error']}")
    runs = tuple(CheckRun(r[0], r[1], _tuples(r[2]), _tuples(r[3]), r[4], r[5])
                 for r in box["runs"])
    return Validation(runs=runs, seconds=box["seconds"],
                      notes=(*box["notes"], "checked on rank 0 before the stages were loaded"))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def _check_locally(model: torch.nn.Module, front: FrontEnd, plan: Plan,
                   options: CompileOptions, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   loader: StageWeights) -> Validation:
    """Rank 0's check on a local program over real copies of the captured graphs."""
    device = loader.device
    real = _with_weights(front, loader, device)
    emitter = Emitter(dataclasses.replace(options, executor="local",
                                          devices=(device,) * len(plan.stages), chunks=None),
                      None, plan)
    emitter.check(real, plan)
    local = CompiledPipeline(model, real, emitter.emit(real, plan), emitter)
    return validate_pipeline(local, real.annotated, _on(args, device), _on(kwargs, device))


def _with_weights(front: FrontEnd, loader: StageWeights, device: torch.device) -> FrontEnd:
    """``front`` with copies of its captured and chunk-step graphs holding real tensors
    (``front`` itself when it holds real tensors: a real model, no copy)."""
    tensors = [*front.annotated.parameters(), *front.annotated.buffers()]
    if not any(t.device.type == "meta" for t in tensors):
        return front
    annotated, chunk = copy.deepcopy(front.annotated), copy.deepcopy(front.chunk)
    modules = [annotated, chunk]
    rest = chunk.meta.get(REST_CHUNK)
    if rest is not None:
        modules.append(rest)
    tail = getattr(chunk, "tppc_tail", None)
    if tail is not None:
        modules.append(tail)
    loader.materialise(*modules)
    for module in modules:
        retarget(module, device)
    return dataclasses.replace(front, annotated=annotated, chunk=chunk)


def retarget(module: torch.nn.Module, device: torch.device) -> None:
    """Point the ``device=meta`` arguments a capture on the meta device baked into the graphs
    (``arange``, ``to``) at ``device``."""
    def swap(arg: Any) -> Any:
        return device if isinstance(arg, torch.device) and arg.type == "meta" else arg

    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        changed = False
        for node in sub.graph.nodes:
            args, kwargs = fx.node.map_aggregate(node.args, swap), \
                fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            sub.recompile()


def _on(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, tuple | list):
        return type(tree)(_on(v, device) for v in tree)
    if isinstance(tree, Mapping):
        return {k: _on(v, device) for k, v in tree.items()}
    return tree
