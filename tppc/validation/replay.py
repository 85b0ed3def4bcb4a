"""Replays for translation validation: the captured graph and an emitted program, side by side.

Terms:
    reference: the unsplit captured graph (:attr:`tppc.frontend.front_end.FrontEnd.annotated`)
        run on flat inputs with an :class:`fx.Interpreter`, optionally keeping the values of
        chosen nodes (copied when made, so later in-place writes do not change them).
    replay: an emitted program run chunk by chunk, stage by stage, in this thread, with a
        hook that sees every stage's outputs of every chunk; a bidirectional model's chunked
        pass runs after a one-chunk warm-up pass has filled the K/V buffers (then every chunk
        reads exact K/V, so the chunked result must equal the unsplit graph).
    origin: the node of the exported graph a node was copied from (``meta["from_node"]``):
        the same for a captured node and its copies in chunk-step and stage graphs, whose
        names may differ.
    chunk rows: the rows of a full-length value that a chunk's value holds (its token axis;
        the first chunk also holds the unsplit prefix of joint attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.backends.torch_local import TORCH_OPS, run_stage
from tppc.calls.call import new_outputs, with_tail
from tppc.calls.io import OutputAssembler
from tppc.errors import TppcError
from tppc.ir.records import TOKEN, TokenInfo
from tppc.program.actions import Action
from tppc.program.interpreter import run_in_order
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, CallState, next_epoch

__all__ = ["Difference", "RecordingStage", "Replay", "StageFailed", "chunk_rows", "compare",
           "origin", "run_reference", "token_info", "tolerance"]

StageHook = Callable[[int, int, tuple[Any, ...]], None]
"""Receives ``(stage, chunk, stage outputs)`` of the checked pass."""

_RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
_NORM_RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


class _Recorder(fx.Interpreter):
    """Runs a graph on flat inputs and keeps a copy of the values of the chosen nodes."""

    def __init__(self, gm: fx.GraphModule, keep: Callable[[fx.Node], bool] | None) -> None:
        super().__init__(gm)
        self.keep, self.values = keep, {}
        self.current: fx.Node | None = None  # the node running (the failing one after a raise)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        value = super().run_node(n)
        if self.keep is not None and self.keep(n):
            self.values[n.name] = _snapshot(value)
        return value


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(v) for v in value)
    return value


def run_reference(gm: fx.GraphModule, flat: Sequence[Any], keep: Collection[str] = ()
                  ) -> tuple[list[Any], dict[str, Any]]:
    """The flat outputs of ``gm`` on ``flat`` inputs, and a copy of the values of the nodes
    named in ``keep``, by name."""
    recorder = _Recorder(gm, (lambda n: n.name in keep) if keep else None)
    with torch.no_grad():
        out = recorder.run(*flat, enable_io_processing=False)
    return (list(out) if isinstance(out, list | tuple) else [out]), recorder.values


class RecordingStage:
    """A stage's runnable that also keeps a copy of every node's value (one chunk's run)."""

    def __init__(self, runnable: fx.GraphModule, *, keep: bool = True) -> None:
        self.graph_module = runnable
        self.keep = keep
        self.values: dict[str, Any] = {}
        self.current: fx.Node | None = None  # the node that raised, after a failed call

    def __call__(self, *args: Any) -> Any:
        recorder = _Recorder(self.graph_module, (lambda n: n.op != "output") if self.keep
                             else None)
        try:
            return recorder.run(*args)
        finally:
            self.values, self.current = recorder.values, recorder.current


class StageFailed(Exception):  # an internal signal, turned into SoundnessError
    """A stage of an emitted program raised (not a :class:`TppcError`) during a replay.

    Attributes:
        stage: the stage index.
        chunk: the chunk index in the pass that failed.
        rows: the chunk's ``(start, end)``.
        layers: the stage's layers.
        node: the stage-graph node that raised (None: not found by a second run).
        error: the exception.
    """

    def __init__(self, stage: int, chunk: int, rows: tuple[int, int], layers: tuple[str, ...],
                 node: fx.Node | None, error: Exception) -> None:
        super().__init__(f"stage {stage} chunk {chunk}: {type(error).__name__}: {error}")
        self.stage, self.chunk, self.rows, self.layers = stage, chunk, rows, layers
        self.node, self.error = node, error


class Replay:
    """One program run on one input (see the module docstring).

    Args:
        program: the program of the chunked pass (and of its first chunk).
        rest: the program of the later chunks (joint attention), or None.
        flat: the model's flat inputs.
        length: units of the sequence axis in ``flat``.
        chunks: the chunked pass's ``(start, end)`` ranges.
        warmup: run one whole-sequence chunk first, in the same call state.
    """

    def __init__(self, program: Program, rest: Program | None, flat: Sequence[Any], length: int,
                 chunks: tuple[tuple[int, int], ...], *, warmup: bool = False) -> None:
        self.program, self.rest, self.flat = program, rest, tuple(flat)
        self.length, self.chunks, self.warmup = length, chunks, warmup

    def stage(self, s: int, m: int) -> StageProgram:
        """Stage ``s`` of the program chunk ``m`` runs on."""
        return (self.program if m == 0 or self.rest is None else self.rest).stages[s]

    def run(self, hook: StageHook | None = None,
            swap: dict[tuple[int, int], StageProgram] | None = None, *,
            locate: bool = True) -> list[Any]:
        """The model's flat outputs; ``swap`` replaces stage ``(s, m)`` of the checked pass.

        Raises:
            StageFailed: a stage raised; ``locate``: its node is found by a second run.
        """
        state, epoch = CallState(self.length), next_epoch()
        if self.warmup and self.chunks != ((0, self.length),):
            self._pass(((0, self.length),), state, epoch, None, {}, locate=False)
        return self._pass(self.chunks, state, epoch, hook, swap or {}, locate=locate)

    def _pass(self, chunks: tuple[tuple[int, int], ...], state: CallState, epoch: int,
              hook: StageHook | None, swap: dict[tuple[int, int], StageProgram], *,
              locate: bool) -> list[Any]:
        axes = self.program.signature.output_axes
        call = Call(self.flat, chunks, self.length, self.length, epoch,
                    new_outputs(self.program.stages[-1], self.length, len(axes)))
        sink = OutputAssembler(axes, call, self.program.signature.output_rows)
        for m, (start, end) in enumerate(chunks):
            values: tuple[Any, ...] = ()
            if self.program.workers:  # sharded stages: their workers and collectives
                sink(m, self._sharded(m, call, state, start, end, hook))
                continue
            for s in range(len(self.program.stages)):
                stage = swap.get((s, m)) or self.stage(s, m)
                try:
                    values = run_stage(stage, call, state, start, end, values)
                except TppcError:
                    raise
                except Exception as exc:  # the emitted program crashed: name where
                    raise StageFailed(s, m, (start, end), tuple(stage.layers),
                                      self._failing_node(s, m) if locate else None,
                                      exc) from exc
                if hook is not None:
                    hook(s, m, values)
            sink(m, values)
        return with_tail(self.program, self.flat, sink.leaves)

    def _sharded(self, m: int, call: Call, state: CallState, start: int, end: int,
                 hook: StageHook | None) -> tuple[Any, ...]:
        """Chunk ``m`` through a program whose stages have several workers (in the dry
        run's order, collectives included); ``hook`` sees rank 0's values of each stage."""
        program = self.program if m == 0 or self.rest is None else self.rest
        workers, out = program.runners, []

        def compute(w: int, act: Action, got: Any) -> tuple[Any, ...]:
            worker = workers[w]
            part = worker.part(act.part)
            try:
                values = run_stage(part, call, state, start, end, got)
            except TppcError:
                raise
            except Exception as exc:
                raise StageFailed(worker.index, m, (start, end), tuple(worker.layers), None,
                                  exc) from exc
            last = act.part == max(len(worker.parts), 1) - 1
            if hook is not None and worker.rank == 0 and last and not worker.joins[act.part:]:
                hook(worker.index, m, values)
            return values

        def output(w: int, act: Action, values: tuple[Any, ...]) -> None:
            if w == program.leader:
                out.append(values)

        run_in_order(program.dry_run(((start, end),)), compute, output=output, ops=TORCH_OPS)
        return out[0]

    def _failing_node(self, s: int, m: int) -> fx.Node | None:
        """The node of stage ``s`` that raises in chunk ``m``: the replay run once more with
        that stage under an interpreter (None when the second run does not raise there)."""
        stage = self.stage(s, m)
        if not isinstance(stage.runnable, fx.GraphModule):
            return None
        recorder = RecordingStage(stage.runnable, keep=False)
        try:
            self.run(swap={(s, m): dataclasses.replace(stage, runnable=recorder)}, locate=False)
        except StageFailed as again:
            return recorder.current if (again.stage, again.chunk) == (s, m) else None
        except Exception:
            return recorder.current
        return None


def origin(node: fx.Node) -> tuple[str, int]:
    """The exported-graph node ``node`` was copied from: ``(name, graph id)`` (see module)."""
    sources = node.meta.get("from_node")
    if not sources:
        return (node.name, 0)
    source = sources[0]
    while getattr(source, "from_node", None):
        source = source.from_node[0]
    return (source.name, source.graph_id)


def chunk_rows(full: Any, got: Any, info: TokenInfo | None, start: int, length: int) -> Any:
    """The rows of ``full`` (a value at ``length`` units) that ``got`` holds for the chunk
    starting at ``start``; ``full`` itself for values without a token axis; None when the
    two cannot be lined up."""
    if not isinstance(full, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None  # tuples (a split's outputs) are compared through their getitems
    if info is None or info.axis is None or info.role not in ("token", "mixing") \
            or info.prefix_only or info.axis >= full.dim() or full.dim() != got.dim():
        return full if full.shape == got.shape else None
    axis, prefix, suffix = info.axis, info.prefix, info.suffix
    scale = (full.shape[axis] - prefix - suffix) // max(1, length)
    lo = 0 if start == 0 else prefix + scale * start
    rows = got.shape[axis]
    if lo + rows > full.shape[axis]:
        return None
    part = full.narrow(axis, lo, rows)
    if start == 0 and suffix and rows < full.shape[axis]:  # [prefix | its rows | suffix]
        part = torch.cat([full.narrow(axis, 0, rows - suffix),
                          full.narrow(axis, full.shape[axis] - suffix, suffix)], axis)
    return part if part.shape == got.shape else None


@dataclass(frozen=True)
class Difference:
    """How far a value is from the captured graph's.

    Attributes:
        max_abs: max ``|got - want|`` (``inf``: shapes, types or non-tensor values differ, or
            an entry is NaN or infinite on one side only).
        tolerance: the max-abs difference accepted (:func:`tolerance`).
        rel_norm: ``‖got - want‖ / ‖want‖``.
        norm_tolerance: the relative norm accepted; None: the max-abs test alone decides
            (fp32, fp64, integers). In fp16 and bf16, rounding differs between a chunked and
            an unsplit computation, so a value fails only when both tests fail.
    """

    max_abs: float
    tolerance: float
    rel_norm: float = 0.0
    norm_tolerance: float | None = None

    @property
    def exceeds(self) -> bool:
        """Whether the value differs beyond the tolerance."""
        if self.max_abs <= self.tolerance:
            return False
        return self.norm_tolerance is None or self.rel_norm > self.norm_tolerance


def tolerance(want: torch.Tensor, ulps: int | None = None) -> float:
    """The largest max-abs difference accepted against ``want``: a relative tolerance by dtype
    (fp32 1e-4, TF32 matmuls 5e-3, bf16 5e-2, fp16 1e-2; fp32 and fp64 at least ``ulps``
    units of the dtype's epsilon) times ``max(1, max |want|)`` over its finite entries; 0
    for integer and bool values."""
    if not want.is_floating_point():
        return 0.0
    rtol = _RTOL.get(want.dtype, 1e-4)
    if ulps is not None and want.dtype in (torch.float32, torch.float64):
        rtol = max(rtol, ulps * torch.finfo(want.dtype).eps)
    if want.dtype == torch.float32 and want.device.type == "cuda" \
            and (torch.backends.cuda.matmul.allow_tf32
                 or torch.get_float32_matmul_precision() != "highest"):
        rtol = 5e-3
    finite = torch.nan_to_num(want.detach(), nan=0.0, posinf=0.0, neginf=0.0)
    scale = float(finite.abs().max()) if want.numel() else 0.0
    return rtol * max(1.0, scale)


def compare(got: Any, want: Any, ulps: int | None = None) -> Difference:
    """How far ``got`` is from ``want`` (tensors, or tuples of them compared pairwise: the
    worst pair), against :func:`tolerance` (``ulps``: at least that many units of the
    dtype's epsilon, relative to the values)."""
    if isinstance(want, list | tuple) and isinstance(got, list | tuple):
        if len(got) != len(want):
            return Difference(float("inf"), 0.0)
        pairs = [compare(g, w, ulps) for g, w in zip(got, want, strict=True)]
        return max(pairs, key=lambda d: (d.exceeds, d.max_abs - d.tolerance),
                   default=Difference(0.0, 0.0))
    if not isinstance(want, torch.Tensor):
        same = not isinstance(got, torch.Tensor) and (got is want or got == want)
        return Difference(0.0 if same else float("inf"), 0.0)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return Difference(float("inf"), 0.0)
    if want.numel() == 0:
        return Difference(0.0, 0.0)
    a, b = got.detach().to(want.device), want.detach()
    if not b.is_floating_point():
        return Difference(float((a.long() - b.long()).abs().max()), 0.0)
    if b.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    one_sided = (a.isnan() ^ b.isnan()) | ((a.isinf() | b.isinf()) & (a != b)
                                           & ~(a.isnan() | b.isnan()))
    if bool(one_sided.any()):
        return Difference(float("inf"), tolerance(want, ulps))
    delta = (a - b).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    finite = b.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    rel = float(delta.norm() / finite.norm().clamp_min(1e-30))
    return Difference(float(delta.abs().max()), tolerance(want, ulps), rel,
                      _NORM_RTOL.get(want.dtype))


def token_info(node: fx.Node) -> TokenInfo | None:
    """The node's :class:`TokenInfo`, or None."""
    return node.meta.get(TOKEN)
