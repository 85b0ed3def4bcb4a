"""The runtime of a compiled pipeline.

compile     ``tppc.compile``: the compile driver and ``manual_plan``
options     ``CompileOptions``: every option, validated up front
frontend    captures per batch shape; binding and checking call inputs
compiled    ``CompiledPipeline``: program cache, per-call states, calls
call        THE call algorithm (bind, program, state, run, release, epilogue, assemble)
generate    pipelined prefill + greedy decoding (the loop: ``tppc.generation``)
io          output assembly
distributed, distributed_generate, distributed_denoise, rank_delivery, result_stream,
shared_results    one rank of a torch.distributed job and how its outputs reach rank 0
owned_files, rank_exit    what a job leaves behind: owner-locked files swept once their
                          owner died; how a rank ends (signals, its launcher's death)
launch    ``tppc.launch``: a job of local ranks
"""

from __future__ import annotations

__all__: list[str] = []
