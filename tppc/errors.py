"""Errors raised by tppc.

Every error names the thing that is wrong, the offending value, and what the user can do.
All derive from :class:`TppcError` so callers can catch one type.
"""

from __future__ import annotations

__all__ = [
    "AnnotationError",
    "ArtifactError",
    "CaptureError",
    "CostModelError",
    "PassError",
    "PlanError",
    "PlanInfeasible",
    "RuntimeInputError",
    "SpecError",
    "StageFailed",
    "StageTimeout",
    "TppcError",
]


class TppcError(Exception):
    """Base class of every error tppc raises on purpose."""


class ArtifactError(TppcError):
    """An artifact directory that is missing, altered, malformed, or from another schema."""


class CaptureError(TppcError):
    """The model could not be captured as an fx graph with a symbolic sequence length."""


class AnnotationError(TppcError):
    """A node mixes values along the token axis in a way tppc cannot pipeline."""


class PassError(TppcError):
    """A compiler pass failed; the message names the pass and the original error."""


class SpecError(TppcError, ValueError):
    """A hardware spec, cluster string or option is invalid."""


class CostModelError(TppcError):
    """A node could not be priced by the cost model."""


class PlanError(TppcError, ValueError):
    """Bad planner arguments (sequence length, granularity, stage count...)."""


class PlanInfeasible(PlanError):
    """No plan fits the cluster (usually memory); the message names each device's need."""


class RuntimeInputError(TppcError, ValueError):
    """Inputs given to a compiled pipeline do not match what it was compiled for."""


class StageTimeout(TppcError, TimeoutError):
    """A pipeline call did not finish in time; the message names the stage that is behind."""


class StageFailed(TppcError, RuntimeError):
    """A stage of a multi-process pipeline raised or died; the message names that stage.

    Attributes:
        returncodes: exit code of every rank, when raised by :func:`tppc.launch` (else ``()``).
    """

    def __init__(self, message: str, returncodes: tuple[int | None, ...] = ()) -> None:
        super().__init__(message)
        self.returncodes = returncodes
