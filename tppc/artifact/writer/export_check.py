"""Translation validation of an export: the ONNX Runtime stages against the torch program.

Terms:
    check length: the example's length with the exported chunks; for a long example
        (:func:`tppc.validation.validate.short_lengths`) the first short probe length on the
        example's first rows, in three chunks (an ONNX stage takes the chunk's start and size
        as inputs, so it runs any length; one chunk for bidirectional attention, as its calls
        run).
    second length: when the capture is dynamic, a second length the check also runs
        (:func:`second_length`): a length the artifact records other than the check length
        (``tppc.export(lengths=...)``, with its exported chunks) when one is at most twice
        it, else the first length a call may have (``max_seq``, the capture's length bound
        and limit) of the long example's second short probe, the check length less one
        granularity and more one; its inputs are the check's cut or extended (their own first
        rows repeated), and it is compared with the torch program and the captured graph. A size
        of the example's length baked into an ONNX graph passes the first check and fails
        this one (by a difference, or ONNX Runtime's error, named with the length).
    stage output: what a stage hands to the next (``boundary.<value>``) or, for the last
        stage, a model output (named by its path: ``logits``, ``0``, ``1.key``).

What runs (:func:`check_export`): the torch program (each stage's outputs of each chunk kept),
the ONNX Runtime stages of the artifact on the same inputs and chunks (each stage's outputs
kept; with tensor-parallel stages only the model's outputs), and the unsplit captured graph;
at the example length also the eager model; then the same at the second length. Every
stage's outputs are compared chunk by chunk, stage by stage: since each ONNX stage receives
the previous ONNX stage's outputs, the first stage whose outputs differ is the one that
computes something else, and :class:`tppc.errors.SoundnessError` names it, the output and the
chunk. The model outputs are then compared with the torch program's, the captured graph's and
the eager model's. ``tppc.export(..., verify=False)`` skips the check.

Tolerance: ONNX Runtime's kernels sum in another order than torch's, which moves a result by
about n·eps times the magnitude of the summed terms, so every comparison accepts
:data:`KERNEL_ULPS` units of the dtype's epsilon times ``max(1, max |value|)`` (fp32: 2.4e-4
of the largest value, where the compile's torch-against-torch check takes 1e-4): relative to
the values, as the tests' kernel tolerance (``tests/oracles.py``), and far below what a wrong
op moves (percents).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tppc.artifact.core.assemble import Assembler, unflatten
from tppc.artifact.core.load import load
from tppc.artifact.core.run import flat_outputs
from tppc.backends.onnxruntime import OrtCall, OrtStage, run_serial
from tppc.errors import SoundnessError
from tppc.validation.localize import describe
from tppc.validation.replay import Difference, Replay, compare, run_reference
from tppc.validation.validate import probe_chunks, resize_inputs, short_lengths

__all__ = ["KERNEL_ULPS", "ExportCheck", "check_export", "second_length"]

KERNEL_ULPS = 2048
"""Units of the dtype's epsilon, times the largest value, an ONNX Runtime stage's output may
differ from torch's by (module docstring)."""


@dataclass(frozen=True)
class ExportCheck:
    """What the check of an export compared.

    Attributes:
        length: the check length (units of the sequence axis).
        chunks: its chunks.
        stage_outputs: stage outputs compared (over every chunk).
        max_diff: the largest max-abs difference of any stage or model output.
        eager: whether the eager model was compared too (the example length).
        second: the second length checked (:func:`second_length`), None for a capture of
            one length.
    """

    length: int
    chunks: tuple[tuple[int, int], ...]
    stage_outputs: int
    max_diff: float
    eager: bool
    second: int | None = None

    def summary(self) -> str:
        """One line."""
        also = "" if self.second is None else f" and length {self.second}"
        return (f"export validated: length {self.length}, {len(self.chunks)} chunk(s){also}, "
                f"{self.stage_outputs} stage outputs, max |diff| {self.max_diff:.2g}"
                + (", eager model compared" if self.eager else ""))


class _Recording:
    """An ORT stage that keeps each chunk's outputs (``outputs[(stage, chunk start)]``)."""

    def __init__(self, stage: OrtStage, outputs: dict[tuple[int, int], list[np.ndarray]]
                 ) -> None:
        self.stage, self.outputs = stage, outputs

    def step(self, call: OrtCall, start: int, end: int, boundary: Sequence[np.ndarray]
             ) -> list[np.ndarray]:
        out = self.stage.step(call, start, end, boundary)
        self.outputs[self.stage.index, start] = out
        return out

    def part(self, index: int) -> _Recording:
        """What a compute of part ``index`` runs (a stage has one part)."""
        return self


def check_export(compiled: Any, path: str | Path, args: tuple[Any, ...],
                 kwargs: Mapping[str, Any] | None = None) -> ExportCheck:
    """Run the artifact at ``path`` on the example and compare it with ``compiled``; then,
    when the capture is dynamic, at a second length (module docstring).

    Raises:
        SoundnessError: an ONNX stage's output, or a model output, differs (or an ONNX stage
            fails at the second length); the message names the stage, the output, the
            chunk, the length and the fix.
    """
    kwargs = dict(kwargs or {})
    front, bound = compiled.bind(args, kwargs)
    program = compiled.program(compiled.plan.seq_len, front)
    length, flat, eager = bound.length, list(bound.flat), True
    chunks = program.chunks if length == program.seq_len else _chunks(front, length)
    short = short_lengths(front, length)
    if short is not None:
        flat, length, eager = resize_inputs(front, flat, length, short[0]), short[0], False
        chunks = _chunks(front, length)
    runner = load(path, threads_per_stage=1)
    leaves = None
    if eager:
        with torch.no_grad():
            leaves = pytree.tree_leaves(compiled.model(*args, **kwargs))
    worst, count, eager = _check_at(compiled, front, program, runner, (flat, length, chunks),
                                    leaves)
    second = second_length(compiled, front, runner, length, short)
    if second is not None:
        n, n_chunks = second
        try:
            more = _check_at(compiled, front, program, runner,
                             (resize_inputs(front, flat, length, n), n, n_chunks), None)
        except SoundnessError:
            raise
        except Exception as exc:  # ONNX Runtime's errors have many types; the length is named
            raise SoundnessError(
                f"{compiled.model_name}: the exported artifact is right at length {length} "
                f"and fails at length {n} ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0][:300]}): a stage's ONNX graph holds a "
                f"size of the example's length. fix: report it with this message, or export "
                "with verify=False to keep this artifact for the example's length only",
                construct="the ONNX translation") from exc
        worst, count = max(worst, more[0]), count + more[1]
    return ExportCheck(length=length, chunks=chunks, stage_outputs=count, max_diff=worst,
                       eager=eager, second=None if second is None else second[0])


def second_length(compiled: Any, front: Any, runner: Any, length: int,
                  short: tuple[int, int] | None
                  ) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """The second length the check runs at, and its chunks, or None (a capture of one length).

    A length the loaded artifact ``runner`` records (``tppc.export(lengths=...)``) other than
    the check length ``length`` and at most twice it, with its exported chunks; else the first
    a call may have (:func:`_admits`, at least 2 units) of the long example's second short
    probe, the check length less one granularity and more one; in :func:`_chunks`.
    """
    ctx, grid = front.ctx, front.ctx.patch_grid
    if ctx.capture_mode != "dynamic" or (len(grid) == 3 and grid[0] > 1):
        return None
    recorded = [n for n in runner.lengths if n != length and n <= 2 * length]
    if recorded:  # a model with bidirectional attention: one chunk, as its calls run
        n = min(recorded)
        return n, ((0, n),) if front.bidirectional else runner.chunks(n)
    step = max(1, compiled.plan.granularity)
    candidates = [*(short[1:] if short is not None else ()), length - step, length + step]
    for n in candidates:
        if n >= 2 and n != length and _admits(compiled, ctx, n):
            return n, _chunks(front, n)
    return None


def _admits(compiled: Any, ctx: Any, units: int) -> bool:
    """Whether a call of ``units`` passes bind's length checks: ``max_seq`` (a block: ``k``
    tokens), the lengths the capture holds (``ctx.length_bound``) and the longest the model
    runs at (``ctx.length_limit``)."""
    limit = compiled.options.max_seq
    if limit is not None and units * (ctx.block_size or 1) > limit:
        return False
    bound = getattr(ctx, "length_bound", None)
    if bound is not None and not bound[0] <= units <= bound[1]:
        return False
    most = getattr(ctx, "length_limit", None)
    return most is None or units <= most[0]


def _chunks(front: Any, length: int) -> tuple[tuple[int, int], ...]:
    """The chunks of a check at a length the plan did not choose: :func:`probe_chunks`, or
    one chunk for a model with bidirectional attention (as its calls run: chunks of a
    diffusion step would read stale K/V)."""
    return ((0, length),) if front.bidirectional else probe_chunks(front, length)[0]


def _check_at(compiled: Any, front: Any, program: Any, runner: Any,
              run: tuple[list[Any], int, tuple[tuple[int, int], ...]],
              eager: list[Any] | None) -> tuple[float, int, bool]:
    """Every stage output of the ORT stages against the torch program's at one length
    (``run``: the flat inputs, the length, the chunks), then the model outputs against the
    torch program's, the captured graph's and ``eager`` (the eager model's, or None).
    Returns the largest difference, the outputs compared, and whether eager was."""
    flat, length, chunks = run
    sent: dict[tuple[int, int], tuple[Any, ...]] = {}
    replay = Replay(program, None, flat, length, chunks)
    with torch.no_grad():
        torch_leaves = replay.run(hook=lambda s, m, out: sent.__setitem__((s, chunks[m][0]),
                                                                          out))
    got: dict[tuple[int, int], list[np.ndarray]] = {}
    ort_leaves = _run_ort(runner, flat, length, chunks, got)
    names = list(flat_outputs(unflatten(runner.signature["out_spec"], iter(ort_leaves))))
    worst, count = 0.0, 0
    for s, stage in enumerate(() if runner.stage_of else runner.stages[:-1]):
        for start, end in chunks:
            for k, name in enumerate(stage.entry["outputs"]):
                want = sent[s, start][k]
                value = np.asarray(got[s, start][k])
                diff = compare(torch.from_numpy(value) if isinstance(want, torch.Tensor)
                               else int(value), want, KERNEL_ULPS)  # a size handed on
                _raise_if(diff, compiled, s, name, (start, end), "the torch program's", length)
                worst, count = max(worst, diff.max_abs), count + 1
    last = len(runner.stages) - 1
    wants = [("the torch program's", torch_leaves),
             ("the captured graph's", run_reference(front.annotated, flat)[0])]
    if eager is not None and len(eager) == len(ort_leaves):
        wants.append(("the eager model's", eager))
    for what, want in wants:
        for j, (value, ref) in enumerate(zip(ort_leaves, want, strict=False)):
            got_j = torch.from_numpy(np.asarray(value)) if isinstance(value, np.ndarray) \
                else value
            diff = compare(got_j, ref, KERNEL_ULPS)
            _raise_if(diff, compiled, last, names[j], (0, length), what, length)
            worst = max(worst, diff.max_abs)
    return worst, count + len(ort_leaves), len(wants) == 3


def _run_ort(runner: Any, flat: Sequence[Any], length: int,
             chunks: tuple[tuple[int, int], ...],
             got: dict[tuple[int, int], list[np.ndarray]]) -> list[Any]:
    """The model's flat outputs of the ORT stages (each stage's outputs kept in ``got``)."""
    arrays = [x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x for x in flat]
    call = OrtCall(flat=arrays, chunks=chunks, seq_len=length, pos_len=length)
    for stage in runner.stages:
        stage.allocate(call, length)
    sink = Assembler(runner.signature["outputs"], length)
    if runner.stage_of:  # tensor-parallel workers: the model's outputs only
        run_serial(runner.stages, call, sink, runner.actions_for(chunks),
                   stage_of=runner.stage_of)
    else:
        run_serial([_Recording(st, got) for st in runner.stages], call, sink)
    return sink.leaves if runner.tail is None else runner.tail(arrays, sink.leaves)


def _raise_if(diff: Difference, compiled: Any, stage: int, output: str,
              chunk: tuple[int, int], what: str, length: int) -> None:
    if not diff.exceeds:
        return
    where = (f"output {output!r} of ONNX stage {stage}" if output.startswith("boundary.")
             else f"model output {output!r} (ONNX stage {stage})")
    raise SoundnessError(
        f"{compiled.model_name}: the exported artifact differs from {what}: {where}, chunk "
        f"[{chunk[0]}, {chunk[1]}) of length {length}: {describe(diff)}; every earlier stage "
        "agrees. The ONNX translation of that stage computes something else (an op translated wrongly, or "
        "ONNX Runtime's numerics). fix: report it with this message, or export with "
        "verify=False to keep this artifact although its outputs differ",
        construct="the ONNX translation", max_diff=diff.max_abs, stage=stage, output=output)
