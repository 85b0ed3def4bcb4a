"""Why a plan has its degrees: the configurations searched and the runner-up.

Terms:
    configuration: one point of the hybrid space: the tensor-parallel degree of every node
        kind, which fixes the groups (stages of ``t`` devices inside one node), the number of
        stages the placement chose, and the replicas of the pipeline the left-over devices
        run (:mod:`tppc.planner.hybrid`).
    degrees: the configuration as the keywords that fix it (``num_stages``,
        ``tensor_parallel``: one int, or a tuple per stage when they differ; ``intra_op``:
        CPU devices whose cores one worker runs as intra-op threads; ``replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HybridChoice", "degrees_text"]


@dataclass(frozen=True, kw_only=True)
class HybridChoice:
    """The search behind a plan's degrees.

    Attributes:
        objective: ``"latency"`` or ``"throughput_per_device"``.
        searched: configurations planned.
        pruned: configurations skipped because their lower bound could not beat the plan.
        infeasible: configurations refused (a degree that does not divide the model's shard
            sizes, memory), with the reason, one line each.
        runner_up: the best other configuration and its predicted latency ("" if none).
        why: one sentence: why this configuration beat the runner-up.
        collectives: per layer, the collectives one chunk of it runs on its group (words).
        spans_nodes: why a group spans a slow (inter-node) link; "" when none does.
    """

    objective: str = "latency"
    searched: int = 1
    pruned: int = 0
    infeasible: tuple[str, ...] = ()
    runner_up: str = ""
    why: str = ""
    collectives: tuple[str, ...] = ()
    spans_nodes: str = ""


def degrees_text(degrees: dict) -> str:
    """``"PP4 x TP8 x 2 replicas"``, ``"PP2 x CFG2 x Ulysses2 x TP1"`` or ``"PP1 x TP1 x
    IntraOp2"``: a configuration in words (the CFG, Ring, Ulysses and intra-op degrees named
    when above 1)."""
    tp = degrees["tensor_parallel"]
    tp_text = str(tp) if isinstance(tp, int) else "(" + ",".join(map(str, tp)) + ")"
    replicas = degrees["replicas"]
    axes = "".join(f" x {name}{degrees.get(key, 1)}" for name, key in (
        ("CFG", "cfg_parallel"), ("Ring", "ring"), ("Ulysses", "ulysses"))
        if degrees.get(key, 1) > 1)
    intra = degrees.get("intra_op", 1)
    intra_text = "" if intra == 1 else " x IntraOp" + (
        str(intra) if isinstance(intra, int) else "(" + ",".join(map(str, intra)) + ")")
    return (f"PP{degrees['num_stages']}{axes} x TP{tp_text}{intra_text}"
            + (f" x {replicas} replicas" if replicas > 1 else ""))
