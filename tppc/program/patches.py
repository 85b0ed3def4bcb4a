"""PipeFusion's patches: one copy of each rule for the torch pipeline and the numpy artifact.

Imports neither torch nor numpy (as :mod:`tppc.generation` for the decode loop):
``cp.denoise``, its per-step and distributed variants (:mod:`tppc.pipefusion.denoise`) and a
loaded artifact's ``runner.denoise`` (:mod:`tppc.artifact.torch_runners.denoise`) call these
rules; what differs between a torch tensor and a numpy array comes in a :class:`TimestepOps`.

Terms:
    unit: one position of the sequence axis as plans count it: a token, or a patch row of a
        latent (``k`` positions of the axis per unit: the patch size; the capture's size
        ``k*s`` of the sequence symbol ``s``).
    patch: a band of whole units ``[a, b)`` of the latent; ``n`` equal patches of ``L``
        units are cut at ``round(i * L / n)``; a patch is the latent rows ``[a·k, b·k)``
        along the latent axis.
    latent axis: the axis the patches cut: the first sequence axis of the latents' input.
    timestep input: the model's timestep for step ``t``: ``transform(t.expand(batch))`` in
        the scheduler's dtype, cast to the input's dtype where that keeps every value.
    patch programs: the warm-up steps' program (the whole latent as one chunk), the
        pipelined steps' (its first patch carries joint attention's text tokens) and, with
        joint attention, the later patches' (no text tokens); built once per batch shape,
        length, patch bounds and placement.

Example:
    >>> patch_bounds(3, 8), patch_bands([(0, 3), (3, 5), (5, 8)], 2)
    ((0, 3, 5, 8), ((0, 6), (6, 10), (10, 16)))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tppc.errors import SpecError

__all__ = ["PatchPrograms", "TimestepOps", "cached_patch_programs", "latent_axis",
           "model_timestep", "patch_bands", "patch_bounds", "rows_per_unit"]

Chunks = tuple[tuple[int, int], ...]


def patch_bounds(patches: Any, length: int) -> tuple[int, ...]:
    """The bounds of ``patches`` equal bands of ``length`` units (module docstring).

    Raises:
        SpecError: ``patches`` not an integer in ``[1, length]``, naming the fix.
    """
    if isinstance(patches, bool) or not isinstance(patches, int) or not 1 <= patches <= length:
        raise SpecError(f"patches={patches!r}; the latent has {length} patch rows. fix: "
                        f"1 <= patches <= {length}")
    return tuple(round(i * length / patches) for i in range(patches + 1))


def patch_bands(patches: Iterable[tuple[int, int]], rows: int) -> tuple[tuple[int, int], ...]:
    """Each patch ``[a, b)``'s latent rows ``[a·rows, b·rows)`` along the latent axis."""
    return tuple((rows * a, rows * b) for a, b in patches)


def rows_per_unit(size: Any) -> int:
    """Positions of a sequence axis per unit: ``k`` of a captured size ``k*s`` (a
    ``torch.SymInt``, read by its sympy expression), 1 for a static size or a bare ``s``."""
    expr = getattr(getattr(size, "node", None), "expr", None)
    if expr is None:
        return 1
    coeff = expr.as_coeff_Mul()[0]
    return int(coeff) if expr.is_Mul and coeff.is_Integer and coeff > 0 else 1


def latent_axis(what: str, seq_axes: Sequence[int], rows: Sequence[int] | None) -> tuple[int, int]:
    """The latent axis and its rows per unit: the first of ``seq_axes`` and its ``rows``
    (``None``: 1) of the input that holds the latents, ``what`` (for the error).

    Raises:
        SpecError: the input has no sequence axis, naming it and the fix.
    """
    if not seq_axes:
        raise SpecError(f"{what} has no sequence axis: denoise cuts the latents into patches "
                        "along it and passes them first. fix: pass the latents as the model's "
                        "first argument, as in the example it was compiled (or exported) with")
    return seq_axes[0], rows[0] if rows else 1


@dataclass(frozen=True)
class TimestepOps:
    """How one side holds the model's timestep input (:func:`model_timestep`).

    Attributes:
        convert: the scheduler's value (a torch tensor, or whatever the transform returned)
            as this side's array (torch: itself; numpy: a copy as an array).
        is_array: whether a value is this side's array (a transform may return a number).
        dtype: an array's dtype.
        cast: ``cast(array, dtype)``: the array in ``dtype``.
        equal: whether two arrays of one dtype hold the same values.
        first: an array's first element as a Python number (the error names it).
        target: the error's words for the input, ``{arg}`` and ``{want}`` filled in.
        fix: the error's fix, ``{dtype}`` (the scheduler's) and ``{arg}`` filled in.
    """

    convert: Callable[[Any], Any]
    is_array: Callable[[Any], bool]
    dtype: Callable[[Any], Any]
    cast: Callable[[Any, Any], Any]
    equal: Callable[[Any, Any], bool]
    first: Callable[[Any], Any]
    target: str
    fix: str


def model_timestep(t: Any, batch: int, transform: Callable[[Any], Any] | None, want: Any,
                   ops: TimestepOps, arg: str) -> Any:
    """The model's timestep input of step ``t`` (a scheduler's torch tensor):
    ``transform(t.expand(batch))`` as ``ops``' array, cast to ``want`` (the input's dtype;
    ``None``: unknown) where that keeps every value (an int64 ``999`` is a float ``999.0``:
    the model computes the same).

    Raises:
        SpecError: the cast would change a value (a fractional timestep into an integer
            input), naming both dtypes and the fix.
    """
    value = t.expand(batch) if t.dim() == 0 else t
    value = ops.convert(transform(value) if transform is not None else value)
    if want is None or not ops.is_array(value) or ops.dtype(value) == want:
        return value
    cast = ops.cast(value, want)
    if not ops.equal(ops.cast(cast, ops.dtype(value)), value):
        raise SpecError(
            f"the scheduler's timesteps are {ops.dtype(value)} ({ops.first(value)!r}), "
            f"{ops.target.format(arg=repr(arg), want=want)}, which cannot hold them. fix: "
            f"{ops.fix.format(dtype=ops.dtype(value), arg=arg)}")
    return cast


class PatchPrograms(NamedTuple):
    """The programs of a denoising call (module docstring): a torch pipeline's
    :class:`tppc.program.program.Program` or an artifact's tuple of ONNX Runtime stages."""

    full: Any
    """The warm-up steps': the whole latent as one chunk."""
    first: Any
    """The pipelined steps' (the first patch's)."""
    rest: Any | None
    """The later patches' (joint attention: no text tokens), or None: :attr:`first`'s."""

    def of_patch(self, m: int) -> Any:
        """The program that runs patch ``m`` of a pipelined step."""
        return self.first if m == 0 or self.rest is None else self.rest


def cached_patch_programs(cache: dict[Any, Any], plan: Any, batch: Any, length: int,
                          bounds: tuple[int, ...], build: Callable[[Any, Chunks], Any],
                          graph: Any, rest_graph: Any | None) -> PatchPrograms:
    """The :class:`PatchPrograms` of a call, built once per (``batch`` shape, ``length``,
    ``bounds``, ``plan``'s placement) into ``cache``: ``build(graph, chunks)`` for the warm-up
    and patch programs, ``build(rest_graph, chunks)`` for the later patches' (if any)."""
    placement = tuple((st.layer_start, st.layer_end, st.device_index,
                       getattr(st, "device_indices", ()),
                       *(getattr(st, d, 1) for d in ("tensor_parallel", "cfg_parallel",
                                                     "ring", "ulysses")))
                      for st in plan.stages)  # the placement and every stage's mesh
    key = (batch, length, bounds, placement)
    if key not in cache:
        chunks = tuple(itertools.pairwise(bounds))
        programs = (build(graph, ((0, length),)), build(graph, chunks),
                    None if rest_graph is None else build(rest_graph, chunks))
        for other in programs[::2]:
            _same_buffers(programs[1], other)
        cache[key] = programs
    return PatchPrograms(*cache[key])


def _same_buffers(first: Any, other: Any) -> None:
    """Refuse programs of one call whose K/V buffers of one name differ in shape (their
    workers' shards of a buffer would not line up: each program is cut on its own graph).

    Raises:
        SpecError: naming the buffer and both shapes.
    """
    if other is None or not hasattr(first, "buffer_specs"):
        return
    mine = {b.name: b.shape for b in first.buffer_specs()}
    for b in other.buffer_specs():
        if b.name in mine and mine[b.name] != b.shape:
            raise SpecError(
                f"K/V buffer {b.name!r} has shape {b.shape} in one denoising program and "
                f"{mine[b.name]} in the patch program: their tensor-parallel cuts differ. "
                "fix: tensor_parallel=1 for denoising with stale patches (and report it)")
