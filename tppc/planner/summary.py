"""``Plan.summary()``: a plan as a readable table.

Stages with their devices (a tensor-parallel or intra-op group lists every member) and degree, memory
per device, busy time; the chunks; the solver; and for a hybrid plan its degrees, the
collectives each layer runs on its group and why this configuration beat the runner-up.
"""

from __future__ import annotations

from typing import Any

from tppc.planner.choice import degrees_text

__all__ = ["plan_summary"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _devices(st: Any) -> str:
    if st.group_size == 1:
        return str(st.device_index)
    ids = st.device_indices
    contiguous = list(ids) == list(range(ids[0], ids[0] + len(ids)))
    return f"{ids[0]}-{ids[-1]}" if contiguous else ",".join(map(str, ids))


def _in_units(plan: Any) -> str:
    if plan.tokens_per_unit == 1:
        return "tokens"
    return f"{plan.unit} ({plan.seq_tokens} tokens)"


def plan_summary(plan: Any) -> str:
    """The table (see the module docstring) of a :class:`tppc.planner.plan.Plan`."""
    w = plan.workload
    steps = "" if w.kind != "diffusion" else f", {w.steps} steps ({w.warmup_steps} warm-up)"
    s = plan.solver
    lines = [
        f"tppc plan: {w.kind}{steps}, seq_len={plan.seq_len} {_in_units(plan)}, "
        f"granularity {plan.granularity}, {plan.num_stages} stages, "
        f"{len(plan.boundaries) - 1} chunks",
        f"predicted latency {_ms(plan.latency)}   lower bound {_ms(plan.lower_bound)} "
        f"(work {_ms(plan.lower_bound_work)}, path {_ms(plan.lower_bound_path)})   "
        f"ratio {plan.ratio_to_bound:.3f}",
        f"solver {s.solver}: {s.status}, objective {_ms(s.objective)}, gap "
        f"{100 * s.gap:.2f}%, {s.seconds:.2f} s" + (f"  [{s.detail}]" if s.detail else ""),
        *([f"split {plan.split.method}: {plan.split.status}, bound for this placement "
           f"{_ms(plan.split.bound)}, gap {100 * plan.split.gap:.2f}%, "
           f"{plan.split.seconds:.2f} s"] if plan.split else []),
    ]
    hybrid = plan.choice is not None or any(st.group_size > 1 for st in plan.stages)
    if hybrid:
        lines.append(f"degrees {degrees_text(plan.degrees)} ({plan.num_devices} devices): "
                     f"{plan.degrees}")
    intra = [st for st in plan.stages if st.intra_op > 1]
    if intra:
        lines.append("intra-op: " + "; ".join(
            (f"stage {st.index} is one worker of {st.intra_op} CPU devices' intra-op threads "
             if st.workers == 1 else f"each of stage {st.index}'s {st.workers} workers runs "
             f"{st.intra_op} CPU devices' cores as intra-op threads ")
            + f"(devices {_devices(st)}; torch splits each op)" for st in intra))
    if plan.stages and plan.stages[0].workers > plan.stages[0].tensor_parallel:
        st = plan.stages[0]
        size = f"{st.workers} workers on {st.group_size} devices" if st.intra_op > 1 \
            else f"{st.workers} devices"
        lines.append(f"each stage is a mesh {st.mesh_label} of {size}, in "
                     "worker order (cfg, ring, ulysses, tp; tp fastest): "
                     + "; ".join(f"stage {s.index}: {s.device_indices}" for s in plan.stages))
    lines += ["", f"{'stage':>5}  {'device':<12} {'devices':<8} {'TP':>3} {'layers':<12} "
                  f"{'memory used / capacity':<24} {'busy':>10}"]
    for st in plan.stages:
        busy = sum(e - b for b, e in zip(plan.start[st.index], plan.end[st.index]))
        mem = f"{st.memory_bytes / 1e9:.2f} / {st.capacity_bytes / 1e9:.2f} GB"
        rng = f"[{st.layer_start}, {st.layer_end})"
        lines.append(f"{st.index:>5}  {st.device_name:<12} {_devices(st):<8} "
                     f"{st.tensor_parallel:>3} {rng:<12} {mem:<24} {_ms(busy):>10}")
    lines += ["", f"chunks ({plan.unit}): " + " ".join(str(c) for c in plan.chunk_sizes)]
    inside = [st.layer_names[0] for st in plan.stages[1:]
              if st.layer_names and st.layer_names[0].endswith((".mlp", ".attn", ".part1"))]
    if inside:  # layer indices count the parts of the blocks cut at their waist
        lines.append("stage boundaries inside a block: " + ", ".join(
            f"before {name}" for name in inside))
    lines += _choice_lines(plan.choice)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _choice_lines(choice: Any) -> list[str]:
    if choice is None:
        return []
    lines = [f"search ({choice.objective}): {choice.searched} configurations planned, "
             f"{choice.pruned} pruned by their bound, {len(choice.infeasible)} infeasible"]
    words = [c for c in dict.fromkeys(choice.collectives) if c]
    if words:
        lines.append("collectives per layer and chunk (serial with the stage's compute): "
                     + "; ".join(words))
    if choice.runner_up:
        lines.append(f"runner-up: {choice.runner_up}")
    if choice.why:
        lines.append(f"why: {choice.why}")
    if choice.spans_nodes:
        lines.append(f"a group spans nodes: {choice.spans_nodes}")
    lines += [f"infeasible: {line}" for line in choice.infeasible[:6]]
    return lines
