"""The compile context: state shared by the passes of one compilation, and pass provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import sympy

__all__ = ["CaptureMode", "CompileContext", "PassRecord"]

CaptureMode = Literal["dynamic", "dynamic-square", "specialized"]
"""Which torch.export strategy captured the model (see :mod:`tppc.capture`)."""


@dataclass(frozen=True)
class PassRecord:
    """Provenance of one pass run: its name, how long it took, and the graph after it."""

    name: str
    seconds: float
    num_nodes: int
    code: str


@dataclass
class CompileContext:
    """State shared by the passes of one compilation (mutable, unlike specs and plans).

    Attributes:
        seq_symbol: sympy symbol of the sequence length in node shapes.
        example_seq: value of ``seq_symbol`` for the example inputs.
        seq_inputs: input name -> tuple of its sequence axes.
        capture_mode: which capture strategy worked.
        token_count: number of tokens as a function of ``seq_symbol`` (set by annotation).
        specialization: for ``specialized`` captures, the guard torch.export added.
        input_names: names of the graph's user inputs, in order.
        model_name: class name of the captured model.
        layers: layer records written by ``group_layers``.
        history: one record per pass run.
    """

    seq_symbol: sympy.Symbol
    example_seq: int
    seq_inputs: dict[str, tuple[int, ...]]
    capture_mode: CaptureMode
    token_count: sympy.Expr | None = None
    specialization: str | None = None
    input_names: tuple[str, ...] = ()
    model_name: str = ""
    layers: list[Any] = field(default_factory=list)
    history: list[PassRecord] = field(default_factory=list)
    capture_seconds: float = 0.0
