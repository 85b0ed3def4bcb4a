"""Errors raised by tppc.

Every error names the thing that is wrong, the offending value, and what the user can do.
All derive from :class:`TppcError` so callers can catch one type.
"""

from __future__ import annotations

__all__ = [
    "ActivationMaskError",
    "AnnotationError",
    "ArtifactError",
    "CaptureError",
    "CostModelError",
    "ExportError",
    "PassError",
    "PlanError",
    "PlanInfeasible",
    "RuntimeInputError",
    "ScheduleError",
    "SoundnessError",
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


class ActivationMaskError(AnnotationError, PassError):
    """An attention mask or float bias (ALiBi-like) computed from activations (hidden
    states), not only from positions, constants, parameters and integer inputs; tppc cannot
    evaluate it per chunk. Raised at annotation, before anything is planned.

    Attributes:
        node: the attention node.
        module: its module path (``""``: top level).
        mask: the mask's node.
        construct: the construct, in words.
    """

    def __init__(self, message: str, *, node: str, module: str, mask: str,
                 construct: str) -> None:
        super().__init__(message)
        self.node, self.module, self.mask, self.construct = node, module, mask, construct


class SoundnessError(TppcError):
    """A compiled program computes something other than the captured model (translation
    validation, :mod:`tppc.validation.validate`); the message names the first diverging node,
    its op, module path and construct, what was compared and the max abs difference.

    Attributes:
        node: the diverging node of the captured graph (None: not localised).
        op: its op.
        module: its module path (``""``: top level).
        layer: the layer it belongs to.
        construct: the construct it belongs to, in words.
        max_diff: the max abs difference of its value (or of the output).
        stage: the stage whose output differs (an export's ONNX stage), else None.
        output: the name of that output (``boundary.<value>``, a model output's path).
    """

    def __init__(self, message: str, *, node: str | None = None, op: str | None = None,
                 module: str | None = None, layer: str | None = None,
                 construct: str | None = None, max_diff: float = float("nan"),
                 stage: int | None = None, output: str | None = None) -> None:
        super().__init__(message)
        self.node, self.op, self.module, self.layer = node, op, module, layer
        self.construct, self.max_diff = construct, max_diff
        self.stage, self.output = stage, output


class SpecError(TppcError, ValueError):
    """A hardware spec, cluster string or option is invalid."""


class ExportError(TppcError):
    """A stage or program that cannot be exported (``tppc.export``), or an artifact that
    cannot be loaded; the message names the node or the file."""


class CostModelError(TppcError):
    """A node could not be priced by the cost model."""


class PlanError(TppcError, ValueError):
    """Bad planner arguments (sequence length, granularity, stage count...)."""


class ScheduleError(PlanError):
    """Per-stage action lists that cannot run (deadlock, an unmatched send or receive, a job
    missing, repeated or out of order); the message prints the action grid, the failing
    action marked."""


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
