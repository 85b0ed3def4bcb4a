"""The compile context: state shared by the passes of one compilation, and pass provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import sympy

__all__ = ["CaptureMode", "CompileContext", "PassRecord"]

CaptureMode = Literal["dynamic", "specialized"]
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
        patch_size: side of a latent patch (1 for token inputs).
        patch_grid: the example latent's patch grid in token order, ``(rows, cols)`` or
            ``(frames, rows, cols)``; ``()`` for token inputs. ``rows`` is ``example_seq``.
        context_inputs: tensor inputs of the context stream (text states, text masks, pooled
            projections): their length is a constant, never tied to the sequence symbol.
        specialized_to: for ``specialized`` captures, input name -> the shape (resolution)
            the graph runs at; capture again (and cache) per resolution. None when dynamic.
        shape_guards: for dynamic captures, torch.export's input guards: called with the
            flat inputs (meta tensors suffice), it raises when the graph was not traced for
            their shapes (a Python branch on a size: PixArt's positional table at its
            ``sample_size``); such a call is captured again. None when there are none.
        length_bound: ``(lo, hi, where)`` when the model's Python branches on the length at
            ``where`` and the capture holds lengths ``lo..hi`` units only
            (:mod:`tppc.frontend.length_bounds`; its shape guards say so too); None otherwise.
        length_limit: ``(units, why)`` when the model runs at no longer length than
            ``units`` (a table of that many positions sliced by the length: MPT's ALiBi; found
            by annotation's mask probes); a longer call is refused. None otherwise.
        size_int: a :class:`tppc.frontend.size_ints.UnitInt` when the sequence symbol counts
            an integer input (QwenImage's ``img_shapes``, LTX's ``num_frames``/``height``/
            ``width``): that int is read from the tokens; the other ints stay constant.
        block_size: ``k`` when the tokens were captured as ``k`` × the sequence symbol (a
            model that pads its sequence to whole blocks of ``k`` rows: Mamba2's chunked
            scan, :mod:`tppc.frontend.block_capture`): the symbol counts blocks, every chunk
            is whole blocks, and a call's length must be a multiple of ``k``; None otherwise.
        joint_inputs: input name -> (axis, context length) of inputs over the joint
            ``[context | tokens]`` sequence, captured with that axis derived from the
            sequence symbol (:mod:`tppc.frontend.joint_inputs`: Chroma's attention mask).
        follower: ``(input, axis, guard)`` when a non-sequence input as long as the units
            (a 1-D table of row positions) pinned the length (``guard``) and was captured as
            a sequence input (:func:`tppc.frontend.joint_inputs.follower_input`).
        example_values: the example's values of the context-stream and integer/bool inputs
            (text masks, ids), so that masks are judged from them, not from zeros.
        rerolled: the ``file:line`` of a Python loop over positions that the capture
            re-rolled into :class:`tppc.ir.loop_scan.LoopScan` nodes
            (:mod:`tppc.frontend.reroll_capture`); None otherwise.
        layers: layer records written by ``group_layers``.
        history: one record per pass run (the capture's, then the latest emissions':
            :data:`tppc.passes.runner.EMISSION_RECORDS`).
        captured_passes: how many records of ``history`` the capture made (set once the
            capture is done; None before).
    """

    seq_symbol: sympy.Symbol
    example_seq: int
    seq_inputs: dict[str, tuple[int, ...]]
    capture_mode: CaptureMode
    token_count: sympy.Expr | None = None
    specialization: str | None = None
    input_names: tuple[str, ...] = ()
    model_name: str = ""
    rerolled: str | None = None
    layers: list[Any] = field(default_factory=list)
    history: list[PassRecord] = field(default_factory=list)
    capture_seconds: float = 0.0
    patch_size: int = 1
    patch_grid: tuple[int, ...] = ()
    context_inputs: tuple[str, ...] = ()
    specialized_to: dict[str, tuple[int, ...]] | None = None
    example_values: dict[str, Any] = field(default_factory=dict)
    shape_guards: Any = None
    length_bound: tuple[int, int, str] | None = None
    length_limit: tuple[int, str] | None = None
    size_int: Any = None
    block_size: int | None = None
    joint_inputs: dict[str, tuple[int, int]] = field(default_factory=dict)
    follower: tuple[str, int, str] | None = None
    captured_passes: int | None = None

    def tokens_per_unit(self) -> int:
        """Tokens per unit of the sequence symbol: a DiT's patch columns (the symbol counts
        patch rows), 1 for an LLM or when the token count is not linear in the symbol."""
        count, sym = self.token_count, self.seq_symbol
        if count is None or sym is None:
            return 1
        try:
            per = count.subs(sym, 1)
            return int(per) if per.is_Integer and count.subs(sym, 2) == 2 * per else 1
        except (AttributeError, TypeError):
            return 1

