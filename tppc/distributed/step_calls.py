"""PipeFusion one call at a time through a job: the drop-in's calls on every rank.

Terms:
    collective step call: every rank runs the diffusers pipeline's own loop and calls the
        transformer together (SPMD); rank 0's inputs are used (validated and broadcast, as
        in ``DistributedPipeline.__call__``); the output reaches every rank, since every
        rank's loop steps its scheduler with it.
    warm call, stale call: as :mod:`tppc.pipefusion.step` (the K/V of a stream kept across
        its calls in each rank's own state): a warm call runs the whole latent through
        every worker's list (:class:`tppc.backends.torch_distributed.DistributedExecutor`);
        a stale call runs its patches through the lowered lists of one step, as
        ``cp.denoise``'s pipelined steps do (:mod:`tppc.distributed.denoise`), without the
        way back (the pipeline's loop steps the latent between calls).
    output: the leader (the first worker of the last stage) assembles the output leaves,
        applies the ``global`` tail and broadcasts them (the wire format); every rank then
        builds the model's output structure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tppc.backends import wire
from tppc.calls.call import with_tail
from tppc.calls.io import OutputAssembler
from tppc.distributed.denoise import DenoisingRank, patch_jobs, rank_programs
from tppc.errors import SpecError
from tppc.pipefusion.step import StepCalls
from tppc.program.patches import PatchPrograms
from tppc.program.program import Program
from tppc.program.state import Call, CallState

__all__ = ["DistributedStepCalls"]


class DistributedStepCalls(StepCalls):
    """:class:`tppc.pipefusion.step.StepCalls` through a job (module docstring); ``cp`` is
    this rank's :class:`tppc.distributed.pipeline.DistributedPipeline`."""

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], stream: Any = None
                 ) -> Any:
        cp: DenoisingRank = self.cp
        args, kwargs = cp.share_inputs("step call", (tuple(args), dict(kwargs)))
        return super().__call__(args, kwargs, stream)

    def programs(self, front: Any, plan: Any, length: int, bounds: tuple[int, ...]
                 ) -> PatchPrograms:
        return rank_programs(self.cp, front, plan, length, bounds)

    def warm(self, full: Program, call: Call, state: CallState) -> list[Any]:
        cp = self.cp
        sink = OutputAssembler(full.signature.output_axes, call, full.signature.output_rows)
        cp.execute(full, call, state, sink=sink)
        return self._share(full, call, sink)

    def stale(self, programs: PatchPrograms, call: Call, state: CallState, done: int
              ) -> list[Any]:
        cp, first = self.cp, programs.first
        if programs.rest is not None:  # every rank decides alike
            raise SpecError(
                "stale calls of a joint-attention DiT (text tokens beside the image, a second program for the later patches) do not "
                "run on the distributed backend yet. fix: warmup_steps=None (every call "
                "warm: exact), or the threads or local executor")
        sink = OutputAssembler(first.signature.output_axes, call, first.signature.output_rows)
        patch_jobs(cp, [call], state, programs, None, done, first.leader, call.chunks, 1,
                   lambda _t, m, values: sink(m, values))
        return self._share(first, call, sink)

    def _share(self, program: Program, call: Call, sink: OutputAssembler) -> list[Any]:
        """The output leaves (after the tail) of the leader, on every rank."""
        cp = self.cp
        leader = program.leader
        leaves = with_tail(program, call.flat_inputs, sink.leaves) if cp.rank == leader \
            else None
        return cp.collective(lambda: wire.broadcast(leaves, leader, cp.device),
                             "step call outputs")
