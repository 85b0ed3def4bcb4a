"""The workload: what one call of the pipeline computes (the planner's input).

Terms:
    step: one pass over the whole sequence (a prefill, or one denoising step).
    pipelined steps: the steps that run chunk by chunk through the stages; the warm-up
        steps before them run the full sequence synchronously (diffusion).
    patch: a chunk of a denoising step (the more patches, the more of the K/V is stale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tppc.errors import PlanError

__all__ = ["Workload"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one call of the pipeline computes.

    Attributes:
        kind: ``"causal_prefill"`` (one pass, attention cost grows with the prefix),
            ``"bidirectional_pass"`` (one pass of a model with bidirectional attention, e.g.
            a DiT's call, one denoising step: one chunk, exact; planned as a prefill) or
            ``"diffusion"`` (``steps`` denoising steps over every chunk, bidirectional).
            ``tppc.plan`` names the one-pass kind after the model's attention.
        steps: denoising steps ``D`` (1 for a one-pass kind).
        warmup_steps: leading steps that run the full sequence synchronously (diffusion).
        max_patches: at most this many patches per step (diffusion; ``None``: any). More
            patches make more of the K/V stale (a quality limit, ``cp.denoise(quality=...)``).
        objective: what the hybrid search (:mod:`tppc.planner.hybrid`) minimises:
            ``"latency"`` (one call) or ``"throughput_per_device"`` (latency × the devices of
            one pipeline).
    """

    kind: Literal["causal_prefill", "bidirectional_pass", "diffusion"] = "causal_prefill"
    steps: int = 1
    warmup_steps: int = 0
    max_patches: int | None = None
    objective: Literal["latency", "throughput_per_device"] = "latency"

    def __post_init__(self) -> None:
        if self.objective not in ("latency", "throughput_per_device"):
            raise PlanError(f"Workload.objective={self.objective!r}; use 'latency' (one call) "
                            "or 'throughput_per_device' (calls per second per device)")
        if self.kind not in ("causal_prefill", "bidirectional_pass", "diffusion"):
            raise PlanError(f"Workload.kind={self.kind!r}; use 'causal_prefill', "
                            "'bidirectional_pass' or 'diffusion'")
        if self.steps < 1:
            raise PlanError(f"Workload.steps={self.steps} must be at least 1")
        if not 0 <= self.warmup_steps <= self.steps:
            raise PlanError(
                f"Workload.warmup_steps={self.warmup_steps} must lie in [0, steps={self.steps}]"
            )
        if self.kind != "diffusion" and (self.steps != 1 or self.warmup_steps != 0):
            raise PlanError(
                f"{self.kind} runs one step; got steps={self.steps}, "
                f"warmup_steps={self.warmup_steps} (use kind='diffusion' for multi-step)"
            )
        if self.max_patches is not None and (self.kind != "diffusion" or self.max_patches < 1):
            raise PlanError(f"Workload.max_patches={self.max_patches} must be None, or an "
                            "integer >= 1 with kind='diffusion'")

    def patch_cap(self, max_chunks: int | None) -> int | None:
        """``max_chunks`` lowered to :attr:`max_patches` (``None`` where neither limits)."""
        caps = [c for c in (max_chunks, self.max_patches) if c is not None]
        return min(caps) if caps else None

    @property
    def pipelined_steps(self) -> int:
        """Steps that run chunk by chunk through the pipeline (``steps - warmup_steps``)."""
        return self.steps - self.warmup_steps
