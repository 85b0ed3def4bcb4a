"""Translation validation: ``tppc.compile`` checks the program it emitted against the capture.

Terms:
    check: one replay of an emitted program (:mod:`tppc.validation.replay`) compared, output by
        output, with the unsplit captured graph on the same inputs (:class:`CheckRun`).
    validation program: the compiled program when it has two stages or more; else the same
        chunk-step graph emitted with two stages (a manual plan cut in the middle of the
        layers), on the compiled stage's device, so that a stage boundary is always crossed.
    probe length: one more sequence length the capture admits (the example length minus the
        plan's granularity, or plus it for short examples); the example's inputs are cut (or
        extended with their own first rows) along every sequence axis to that length.
    long example: more than :data:`LONG_TOKENS` tokens. Its check at its own length would cost
        a few forwards of the model (7x the compile of a 200 M Llama at 2048 tokens), so it is
        checked at two short probe lengths instead (:func:`short_lengths`: 64 tokens, more with
        a sliding window, and a quarter fewer). The emitted stage graphs do not depend on the
        length (the same graphs run every length; positional values are computed per call),
        so the short check replays the very stages the example's program runs.

What runs (:func:`validate_pipeline`), for an example that is not long (or ``verify="full"``):
the compiled program with its own chunks on the example (what a call returns); the validation
program on the example in two or three chunks (a bidirectional model's chunked pass runs after
a one-chunk pass filled its K/V buffers); the validation program at the probe length in two or
three chunks. For a long example: the validation program at the two short lengths, in three
chunks each (on the example's first rows). A difference above the
tolerance (:func:`tppc.validation.replay.tolerance`) is localised and raised as
:class:`tppc.errors.SoundnessError` (:mod:`tppc.validation.localize`). Skipped for models on the
meta device (planning only) and with ``verify=False``.

Example:
    >>> cp = tppc.compile(model, (ids,))                              # doctest: +SKIP
    >>> print(cp.validation.summary())
    validated in 0.05 s: lengths (32, 31), max |diff| 2.4e-07
      compiled program  length 32  chunks 1  stages 1
      ...
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tppc.driver.emit import build_program
from tppc.driver.options import CompileOptions
from tppc.frontend.front_end import BoundCall, FrontEnd
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.planner.manual import manual_plan
from tppc.planner.plan import Plan
from tppc.program.program import Program
from tppc.validation.localize import raise_crash, raise_divergence
from tppc.validation.replay import (
    Difference,
    Replay,
    StageFailed,
    compare,
    run_reference,
    token_info,
)

__all__ = ["LONG_TOKENS", "SHORT_TOKENS", "CheckRun", "Validated", "Validation",
           "check_replay", "probe_chunks", "probe_length", "resize_inputs", "short_lengths",
           "validate_pipeline"]

LONG_TOKENS = 256
"""An example with more tokens is validated at short probe lengths (:func:`short_lengths`)."""
SHORT_TOKENS = 64
"""Tokens of the first short probe length."""


@dataclass(frozen=True)
class CheckRun:
    """One replay compared with the captured graph.

    Attributes:
        label: ``"compiled program"`` or ``"validation program"``.
        length: units of the sequence axis (tokens; a DiT's patch rows).
        chunks: the chunks of the compared pass.
        stages: the layers of each stage.
        warmup: a one-chunk pass filled the K/V buffers first (bidirectional attention).
        max_diff: the largest max-abs difference over the outputs.
    """

    label: str
    length: int
    chunks: tuple[tuple[int, int], ...]
    stages: tuple[tuple[str, ...], ...]
    warmup: bool
    max_diff: float


@dataclass(frozen=True)
class Validation:
    """What ``tppc.compile`` checked before returning a pipeline (``cp.validation``).

    Attributes:
        runs: every check, in order.
        seconds: wall time of the whole validation.
        notes: what was not checked, and why (no probe length, one token).
        skipped: why nothing was checked (the meta device), else None.
    """

    runs: tuple[CheckRun, ...]
    seconds: float
    notes: tuple[str, ...] = ()
    skipped: str | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sequence lengths checked, the example's first."""
        return tuple(dict.fromkeys(run.length for run in self.runs))

    @property
    def max_diff(self) -> float:
        """The largest max-abs difference of any check (0.0 when nothing ran)."""
        return max((run.max_diff for run in self.runs), default=0.0)

    def summary(self) -> str:
        """A few lines: lengths, chunks, stages and the differences."""
        if self.skipped:
            return f"not validated: {self.skipped}"
        lines = [f"validated in {self.seconds:.2f} s: lengths {self.lengths}, "
                 f"max |diff| {self.max_diff:.2g}"]
        lines += [f"  {r.label:<18} length {r.length:<5} chunks {len(r.chunks):<2} stages "
                  f"{len(r.stages)}{'  (after a warm-up pass)' if r.warmup else ''}  "
                  f"max |diff| {r.max_diff:.2g}" for r in self.runs]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class Validated(Protocol):
    """What :func:`validate_pipeline` reads of a pipeline (a :class:`tppc.CompiledPipeline`)."""

    plan: Plan
    options: CompileOptions

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]: ...

    def program(self, length: int, front: FrontEnd | None = None) -> Program: ...


def validate_pipeline(cp: Validated, model: torch.nn.Module, args: tuple[Any, ...],
                      kwargs: Mapping[str, Any] | None = None) -> Validation:
    """Check ``cp`` (a :class:`tppc.CompiledPipeline`) against its capture.

    Args:
        cp: the compiled pipeline.
        model: the model it was compiled from.
        args: the example's positional inputs.
        kwargs: the example's keyword inputs.

    Returns:
        The :class:`Validation` record (``skipped`` on the meta device).

    Raises:
        SoundnessError: a program's output differs from the captured graph's; the message
            names the first diverging node (see :mod:`tppc.validation.localize`).
    """
    start = time.perf_counter()
    skip = _skip_reason(model, args, kwargs or {})
    if skip is not None:
        return Validation(runs=(), seconds=0.0, skipped=skip)
    front, bound = cp.bind(args, kwargs or {})
    length, flat, notes = bound.length, bound.flat, []
    if cp.plan.seq_len != length:  # a given plan for another length (with_plan)
        notes.append(f"the example's {length} units resized to the plan's {cp.plan.seq_len}")
        flat = resize_inputs(front, flat, length, cp.plan.seq_len)
        length = cp.plan.seq_len
    compiled = cp.program(length, front)
    staged = _validation_program(front, compiled)
    short = None if cp.options.verify == "full" else short_lengths(front, length)
    if short is None:
        runs = _example_checks(cp, front, flat, length, compiled, staged, notes)
    else:
        notes.append(f"a long example ({length} units of sequence): checked at {short[0]} and "
                     f"{short[1]} units (its first rows); verify='full' also checks {length}")
        runs = [_probe_check(front, staged, flat, length, probe) for probe in short]
    if len(staged.stages) < 2:
        notes.append(f"{len(front.ctx.layers)} layer(s): one stage only")
    return Validation(runs=tuple(runs), seconds=time.perf_counter() - start, notes=tuple(notes))


def _example_checks(cp: Validated, front: FrontEnd, flat: Sequence[Any], length: int,
                    compiled: Program, staged: Program, notes: list[str]) -> list[CheckRun]:
    """The compiled program and the validation program at the example length, then the
    validation program at the probe length (:func:`probe_length`)."""
    reference = run_reference(front.annotated, flat)[0]
    runs = [check_replay(front, "compiled program", compiled, None, flat, length, compiled.chunks,
                   warmup=False, reference=reference)]
    chunks, note = probe_chunks(front, length)
    if note:
        notes.append(note)
    if staged is not compiled or chunks != compiled.chunks:
        runs.append(check_replay(front, "validation program", staged, _rest(front, staged, chunks),
                           flat, length, chunks, warmup=bool(front.bidirectional),
                           reference=reference))
    probe, note = probe_length(front, cp, length)
    if probe is None:
        notes.append(note)
    else:
        runs.append(_probe_check(front, staged, flat, length, probe))
    return runs


def _probe_check(front: FrontEnd, staged: Program, flat: Sequence[Any], length: int,
                 probe: int) -> CheckRun:
    """The validation program on the example cut (or extended) to ``probe`` units."""
    chunks = probe_chunks(front, probe)[0]
    return check_replay(front, "validation program", staged, _rest(front, staged, chunks),
                  resize_inputs(front, flat, length, probe), probe, chunks,
                  warmup=bool(front.bidirectional))


def short_lengths(front: FrontEnd, length: int) -> tuple[int, int] | None:
    """Two short probe lengths for a long example, or None: check at the example length.

    An example is long when it has more than ``LONG_TOKENS`` tokens (a DiT's unit is a patch
    row of ``cols`` tokens). The first probe has ``SHORT_TOKENS`` tokens (at least 4 units:
    three chunks) and one sliding window and a half more where the model has a window; the
    second a quarter fewer units (another remainder of every division). None when the
    capture admits no other length, or the probe would not be shorter than the example.
    """
    ctx, grid = front.ctx, front.ctx.patch_grid
    if ctx.capture_mode != "dynamic" or (len(grid) == 3 and grid[0] > 1):
        return None
    per_unit = grid[-1] if len(grid) == 2 else 1
    if length * per_unit <= LONG_TOKENS:
        return None
    windows = [info.mask.window for n in front.annotated.graph.nodes
               if (info := token_info(n)) is not None and info.mask is not None
               and info.mask.window is not None and info.mask.window < length * per_unit]
    tokens = max([SHORT_TOKENS, *(w + w // 2 + 1 for w in windows)])
    first = max(4, -(-tokens // per_unit))
    if first >= length:
        return None
    return first, first - max(1, first // 4)


def check_replay(front: FrontEnd, label: str, program: Program, rest: Program | None,
                 flat: Sequence[Any], length: int, chunks: tuple[tuple[int, int], ...], *,
                 warmup: bool, reference: list[Any] | None = None) -> CheckRun:
    """Replay ``program`` and compare every output with the captured graph's (``reference``:
    computed here when not given)."""
    if reference is None:
        reference = run_reference(front.annotated, flat)[0]
    warmup = warmup and chunks != ((0, length),)
    replay = Replay(program, rest, flat, length, chunks, warmup=warmup)
    try:
        with torch.no_grad():
            got = replay.run()
    except StageFailed as failed:  # the emitted program crashed: unsound for this model
        raise_crash(front, replay, failed, label=label)
    worst = 0.0
    for index, (value, want) in enumerate(zip(got, reference, strict=False)):
        diff = compare(value, want)
        if diff.exceeds:
            raise_divergence(front, replay, index, diff, label=label)
        worst = max(worst, diff.max_abs)
    if len(got) != len(reference):
        raise_divergence(front, replay, min(len(got), len(reference)),
                         Difference(float("inf"), 0.0), label=label)
    return CheckRun(label=label, length=length, chunks=chunks,
                    stages=tuple(st.layers for st in program.stages), warmup=warmup,
                    max_diff=worst)


def _validation_program(front: FrontEnd, compiled: Program) -> Program:
    """The compiled program when it has two stages (or the model one layer), else the chunk
    step emitted in two stages on the compiled stage's device."""
    names = [layer.name for layer in front.ctx.layers]
    if len(compiled.stages) >= 2 or len(names) < 2:
        return compiled
    cut = len(names) // 2
    plan = manual_plan(names, compiled.seq_len, cuts=(0, cut, len(names)),
                       boundaries=(0, compiled.seq_len))
    device = compiled.stages[0].device
    return build_program(front.chunk, front.ctx, plan, plan.chunks, (device, device))


def _rest(front: FrontEnd, program: Program, chunks: tuple[tuple[int, int], ...]
          ) -> Program | None:
    """The later chunks' program of a model with a text prefix (joint attention), else None."""
    rest = front.chunk.meta.get(REST_CHUNK)
    if rest is None or len(chunks) < 2:
        return None
    return build_program(rest, front.ctx, program.plan, chunks,
                         tuple(st.device for st in program.stages))


def probe_chunks(front: FrontEnd, length: int) -> tuple[tuple[tuple[int, int], ...], str]:
    """The chunks a check runs at ``length``: two or three of unequal sizes, or one and why."""
    if length < 2:
        return ((0, length),), f"the example has {length} unit of sequence: one chunk"
    cuts = sorted({0, *(c for c in (length // 3, (2 * length) // 3 + 1) if 0 < c < length),
                   length})
    return tuple(itertools.pairwise(cuts)), ""


def probe_length(front: FrontEnd, cp: Validated, length: int) -> tuple[int | None, str]:
    """One more length the capture admits (in units, as ``length``), or None and why not.

    ``max_seq`` counts tokens: a block capture's probe of ``n`` blocks has ``n · k`` tokens
    (``ctx.block_size``), as a call's length is (:meth:`tppc.pipeline.captures.Captures.bind`)."""
    ctx = front.ctx
    if ctx.capture_mode == "specialized":
        return None, (f"no probe length: the capture is specialised to {ctx.specialized_to} "
                      f"({ctx.specialization})")
    step = max(1, cp.plan.granularity)
    probe = length - step if length - step >= 2 else length + step
    limit, block = cp.options.max_seq, ctx.block_size or 1
    if limit is not None and probe * block > limit:
        held = "" if block == 1 else f" blocks of {block} = {probe * block} tokens"
        return None, f"no probe length: {probe}{held} is over max_seq={limit}"
    return probe, ""


def resize_inputs(front: FrontEnd, flat: Sequence[Any], length: int, probe: int) -> list[Any]:
    """The flat inputs cut (or extended with their own first rows) along every sequence axis
    from ``length`` to ``probe`` units (and the int that counts the units, ``ctx.size_int``,
    set to ``probe``)."""
    out = []
    unit = getattr(front.ctx.size_int, "placeholder", None)  # the int that counts the units
    for ph, value in zip(front.placeholders, flat, strict=False):
        value = probe if ph.name == unit else value
        for axis in front.ctx.seq_inputs.get(ph.name, ()):
            per = value.shape[axis] // length
            if probe <= length:
                value = value.narrow(axis, 0, per * probe)
            else:
                reps = -(-probe // length)
                value = torch.cat([value] * reps, axis).narrow(axis, 0, per * probe)
        out.append(value)
    return out


def _skip_reason(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                 ) -> str | None:
    tensors = [*model.parameters(), *model.buffers(), *args, *kwargs.values()]
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return "the model or its inputs are on the meta device (planning only)"
    return None
