"""The ``local`` executor: every stage in order, chunk by chunk, in the calling thread.

Terms:
    call: one run of the pipeline on one sequence: the flat user inputs, the chunks, the
        sequence length and the length the positional values are evaluated at (the buffer
        length in use; larger than the sequence during generation).
    stage runner: a stage graph on its device with its K/V buffers and, per call, its
        full-length positional values; ``run`` executes one chunk.

The last stage writes a bias-free linear output (an LM head) straight into the call's
full-length output when the call carries one (:mod:`tppc.backends._direct_output`).

This executor is the reference the others are tested against; it also runs the decoding
steps of ``generate`` (one token through every stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.backends._direct_output import OutSlot, write_outputs_in_place
from tppc.ir import CHUNK_INPUT, CHUNK_SIGNATURE, STAGE_INFO, ChunkInput, StageInfo

__all__ = ["Call", "LocalExecutor", "Sink", "StageRunner"]

Sink = Callable[[int, tuple[Any, ...]], None]
"""Receives ``(chunk index, last stage's outputs)`` in chunk order, in the calling thread."""


@dataclass(frozen=True)
class Call:
    """One run of the pipeline (see the module docstring).

    Attributes:
        flat_inputs: the model's flat user inputs (full sequence).
        chunks: ``(start, end)`` token ranges, in order.
        seq_len: tokens in the sequence.
        pos_len: length the positional values are evaluated at (``≥`` every chunk's end).
        epoch: calls with the same ``(epoch, pos_len)`` reuse the positional values (they
            depend only on shapes; ``generate`` evaluates them once for all its steps).
        outputs: full-length model outputs (by flat output index, ``None`` where absent)
            that the last stage writes its out slots into; empty: fresh tensors per chunk.
    """

    flat_inputs: tuple[Any, ...]
    chunks: tuple[tuple[int, int], ...]
    seq_len: int
    pos_len: int
    epoch: int
    outputs: tuple[Any, ...] = ()


class StageRunner:
    """A stage graph on its device, with its K/V buffers and positional values.

    Attributes:
        module: the stage graph.
        program: what runs: the stage graph, or (last stage) its copy with out slots.
        out_slots: the last stage's outputs written in place, by placeholder name.
    """

    def __init__(self, module: fx.GraphModule, device: torch.device,
                 buffers: dict[str, torch.Tensor]) -> None:
        """Args: the stage graph (already on ``device``), its device, its K/V buffers."""
        self.module = module
        self.device = device
        self.info: StageInfo = module.meta[STAGE_INFO]
        self.buffers = buffers
        self.specs: list[tuple[str, ChunkInput]] = [
            (p.name, p.meta[CHUNK_INPUT]) for p in module.graph.find_nodes(op="placeholder")]
        self._positional: tuple[Any, ...] = ()
        self._prepared: tuple[int, int] | None = None
        self.out_slots: dict[str, OutSlot] = {}
        self.program = module
        if not self.info.outputs:  # the last stage: its outputs are the model's
            axes = module.meta[CHUNK_SIGNATURE].output_axes
            self.program, self.out_slots = write_outputs_in_place(module, axes)

    def new_outputs(self, seq_len: int, count: int) -> tuple[Any, ...]:
        """Empty full-length outputs for this (last) stage's out slots, by flat index."""
        outputs: list[Any] = [None] * count
        for slot in self.out_slots.values():
            outputs[slot.index] = torch.empty(slot.full_shape(seq_len), dtype=slot.dtype,
                                              device=self.device)
        return tuple(outputs)

    def prepare(self, call: Call) -> None:
        """Evaluate this stage's positional values at ``call.pos_len`` (zero-valued inputs)."""
        key = (call.pos_len, call.epoch)
        if self._prepared == key:
            return
        program = self.module.tppc_positional
        inputs = []
        for ph, value in zip(program.graph.find_nodes(op="placeholder"), call.flat_inputs):
            inputs.append(_zeros_like_at(value, ph, call.pos_len, self.device))
        with torch.no_grad():
            self._positional = tuple(program(*inputs))
        self._prepared = key

    def run(self, call: Call, start: int, end: int, boundary: Sequence[Any]) -> tuple[Any, ...]:
        """Run chunk ``[start, end)``; ``boundary`` are the previous stage's outputs."""
        args: list[Any] = []
        size = end - start
        received = iter(boundary)
        for name, spec in self.specs:
            kind = spec.kind
            if kind == "boundary":
                value = next(received)
                args.append(value.to(self.device, non_blocking=True)
                            if isinstance(value, torch.Tensor) else value)
            elif kind == "token":
                args.append(call.flat_inputs[spec.index].narrow(spec.axis, start, size)
                            .to(self.device))
            elif kind == "const":
                value = call.flat_inputs[spec.index]
                args.append(value.to(self.device) if isinstance(value, torch.Tensor) else value)
            elif kind == "positional":
                value = self._positional[spec.index]
                args.append(value if spec.axis is None else value.narrow(spec.axis, start, size))
            elif kind in ("key", "value"):
                args.append(self.buffers[name])
            else:
                args.append({"chunk_start": start, "chunk_size": size,
                             "seq_len": call.seq_len}[kind])
        for slot in self.out_slots.values():
            full = call.outputs[slot.index] if call.outputs else None
            args.append(torch.empty(slot.full_shape(size), dtype=slot.dtype, device=self.device)
                        if full is None else full.narrow(slot.axis, start, size))
        with torch.no_grad():
            return tuple(self.program(*args))


def _zeros_like_at(value: Any, placeholder: fx.Node, length: int, device: torch.device) -> Any:
    """A zero-valued stand-in for a flat input, its sequence axes set to ``length``."""
    if not isinstance(value, torch.Tensor):
        return value
    val = placeholder.meta.get("val")
    if val is None or not any(isinstance(s, torch.SymInt) for s in val.shape):
        return value.to(device)
    shape = [length if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
    return torch.zeros(shape, dtype=value.dtype, device=device)


class LocalExecutor:
    """Runs every stage in order in the calling thread (the reference executor)."""

    name = "local"

    def check(self, runners: Sequence[StageRunner]) -> str | None:
        """None: it can run any stages."""
        return None

    def run(self, runners: Sequence[StageRunner], call: Call, sink: Sink | None = None
            ) -> list[tuple[Any, ...]]:
        """Every chunk through every stage.

        Returns the last stage's outputs per chunk, or ``[]`` when they go to ``sink``.
        """
        for runner in runners:
            runner.prepare(call)
        results = []
        for i, (start, end) in enumerate(call.chunks):
            values: tuple[Any, ...] = ()
            for runner in runners:
                values = runner.run(call, start, end, values)
            if sink is None:
                results.append(values)
            else:
                sink(i, values)
        return results
