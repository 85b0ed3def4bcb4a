"""The workers of one stage as a mesh of parallel axes, and the groups each axis runs over.

Terms:
    axis: one way a stage's work is divided among its workers, outermost first
        (:data:`AXES`): ``cfg`` (the call's batch cut into equal parts: classifier-free
        guidance), ``ring`` (the tokens cut; K/V passed around the group), ``ulysses`` (the
        tokens cut; tokens exchanged for heads around each attention) and ``tp`` (the
        weights cut: tensor parallelism).
    rank: a worker's place in its stage, ``0 .. size - 1``; its coordinates are the rank
        written in the mixed radix of the degrees, ``tp`` the fastest digit (the devices of
        a tensor-parallel group are neighbours, as they need the fastest links).
    group of ``axis`` for a rank: the ranks that differ from it only in ``axis``'s
        coordinate, in coordinate order; a collective of that axis runs over them.

Example:
    >>> mesh = Mesh(cfg=2, tp=2)
    >>> mesh.size, mesh.coords(3), mesh.members("cfg", 3), mesh.members("tp", 3)
    (4, {'cfg': 1, 'ring': 0, 'ulysses': 0, 'tp': 1}, (1, 3), (2, 3))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tppc.errors import PlanError

__all__ = ["AXES", "Mesh"]

AXES: tuple[str, ...] = ("cfg", "ring", "ulysses", "tp")
"""The parallel axes of a stage, outermost first."""


@dataclass(frozen=True)
class Mesh:
    """The degrees of one stage's axes (see the module docstring).

    Attributes:
        cfg: batch parts.
        ring: token parts that pass K/V around.
        ulysses: token parts that exchange tokens for heads.
        tp: weight shards.
    """

    cfg: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            d = getattr(self, axis)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise PlanError(f"Mesh: {axis}={d!r} must be an integer >= 1")

    @classmethod
    def of_stage(cls, stage: object) -> Mesh:
        """The mesh of a :class:`tppc.planner.StagePlan`."""
        return cls(cfg=stage.cfg_parallel, ring=stage.ring,  # type: ignore[attr-defined]
                   ulysses=stage.ulysses, tp=stage.tensor_parallel)  # type: ignore[attr-defined]

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degrees in :data:`AXES` order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def size(self) -> int:
        """Workers of the stage."""
        return math.prod(self.degrees)

    def coords(self, rank: int) -> dict[str, int]:
        """``{axis: coordinate}`` of ``rank``."""
        if not 0 <= rank < self.size:
            raise PlanError(f"Mesh{self.degrees}: rank {rank} is not in 0..{self.size - 1}")
        out: dict[str, int] = {}
        for axis, d in reversed(tuple(zip(AXES, self.degrees, strict=True))):
            out[axis], rank = rank % d, rank // d
        return {a: out[a] for a in AXES}

    def rank(self, coords: dict[str, int]) -> int:
        """The rank of ``coords`` (missing axes: 0)."""
        r = 0
        for axis, d in zip(AXES, self.degrees, strict=True):
            c = coords.get(axis, 0)
            if not 0 <= c < d:
                raise PlanError(f"Mesh{self.degrees}: {axis} coordinate {c} is not in 0..{d - 1}")
            r = r * d + c
        return r

    def members(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group of ``axis`` (``rank`` included), in order."""
        if axis not in AXES:
            raise PlanError(f"Mesh: unknown axis {axis!r}; the axes are {AXES}")
        where = self.coords(rank)
        return tuple(self.rank({**where, axis: c}) for c in range(getattr(self, axis)))

    def group_index(self, axis: str, rank: int) -> int:
        """Which of the stage's groups of ``axis`` holds ``rank`` (0 .. size / degree - 1):
        the rank of its first member among the groups' first members."""
        first = self.members(axis, rank)[0]
        return sorted({self.members(axis, r)[0] for r in range(self.size)}).index(first)
