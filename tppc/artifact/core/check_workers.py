"""What ``tppc.load`` checks of an artifact's tensor-parallel stages (``plan.json["workers"]``).

Terms:
    worker, part: rank ``r`` of stage ``s``'s group and the pieces its shard is cut into at
        the group's collectives (:mod:`tppc.artifact.writer.sharded`); each part's entry has
        a stage entry's fields.
    chain: the workers of each stage are ranks ``0 .. t-1`` in order, every stage from 0
        has workers, the ranks of a stage run the same collectives, a part's outputs are
        ``carry.<j>`` (before a collective), the stage's ``boundary.<name>`` values (its
        last part) or the model's ``output.<j>`` (the last stage's last part), and the first
        part of stage ``s`` receives what the last part of stage ``s - 1`` sends.

Imports no torch (see :mod:`tppc.artifact.core.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tppc.artifact.core.check import (
    check_external,
    check_model_outputs,
    check_wiring,
    record_id_ranges,
    refuse,
    same_names,
)
from tppc.artifact.core.graph_io import read_graph

__all__ = ["check_worker_graphs", "check_workers", "layout"]

_JOINS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def layout(doc: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...],
                                         tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]]:
    """``(stage of each worker, parts of each worker, joins of each worker)``."""
    workers = doc["workers"]
    return (tuple(w["stage"] for w in workers), tuple(len(w["parts"]) for w in workers),
            tuple(tuple((k, tuple(d)) for k, d in w["joins"]) for w in workers))


def check_workers(doc: dict[str, Any], check_entry: Callable[[Any, int, str], None]) -> None:
    """The types of ``plan.json["workers"]`` and the chain of the module docstring
    (``check_entry(entry, stage, where)``: a stage entry's field checks).

    Raises:
        ArtifactError: naming the worker, the field, the value and the fix.
    """
    workers = doc["workers"]
    if not isinstance(workers, list):
        refuse(f"workers is {str(workers)[:60]}, expected a list")
    if not workers:
        return
    if doc["stages"]:
        refuse(f"the artifact lists {len(doc['stages'])} stages and tensor-parallel workers; "
                "an export writes one or the other")
    ranks: dict[int, list[dict[str, Any]]] = {}
    for w, worker in enumerate(workers):
        at = f"workers[{w}]"
        ok = isinstance(worker, dict) and all(
            isinstance(worker.get(k), int) and not isinstance(worker.get(k), bool)
            for k in ("stage", "rank")) and isinstance(worker.get("parts"), list) \
            and len(worker["parts"]) > 0 and isinstance(worker.get("joins"), list) \
            and len(worker["joins"]) == len(worker["parts"]) - 1 and all(
                isinstance(j, list) and len(j) == 2 and j[0] in _JOINS
                and isinstance(j[1], list) and all(isinstance(d, int) for d in j[1])
                for j in worker["joins"])
        if not ok:
            refuse(f"{at} is {str(worker)[:80]}, expected {{stage, rank, parts (non-empty), "
                    f"joins (one [kind in {_JOINS}, dims] per part but the last)}}")
        for p, entry in enumerate(worker["parts"]):
            check_entry(entry, worker["stage"], f"{at}.parts[{p}]")
            check_wiring(entry, f"{at}.parts[{p}]", doc["signature"]["inputs"])
        ranks.setdefault(worker["stage"], []).append(worker)
    if sorted(ranks) != list(range(len(ranks))):
        refuse(f"workers belong to stages {sorted(ranks)}, expected 0 .. {len(ranks) - 1}")
    placement = doc.get("placement")
    if isinstance(placement, list) and len(placement) != len(ranks):
        refuse(f"placement lists {len(placement)} stages and workers {len(ranks)}")
    n_out = len(doc["signature"]["outputs"])
    for s in range(len(ranks)):
        group = ranks[s]
        if [w["rank"] for w in group] != list(range(len(group))):
            refuse(f"stage {s} has workers of ranks {[w['rank'] for w in group]}, expected "
                    f"0 .. {len(group) - 1} in order")
        if any(w["joins"] != group[0]["joins"] for w in group):
            refuse(f"the workers of stage {s} run different collectives")
        for worker in group:
            _check_chain(worker, s, len(ranks), n_out,
                         ranks[s - 1][0]["parts"][-1]["boundary_out"] if s else [])


def _check_chain(worker: dict[str, Any], s: int, n_stages: int, n_out: int,
                 before: list[str]) -> None:
    """One worker's part outputs and what its first part receives (module docstring)."""
    parts, where = worker["parts"], f"stage {s} rank {worker['rank']}"
    if parts[0]["boundary_in"] != before:
        refuse(f"{where} part 0 receives {parts[0]['boundary_in']}, but the stage before "
                f"sends {before} (stages removed or reordered)")
    for p, entry in enumerate(parts):
        received = [i["name"] for i in entry["inputs"] if i["kind"] == "boundary"]
        if received != entry["boundary_in"]:
            refuse(f"{where} part {p} has boundary inputs {received}, its boundary_in is "
                    f"{entry['boundary_in']}")
        if p < len(parts) - 1:
            ok = bool(entry["outputs"]) and all(o == f"carry.{j}"
                                                for j, o in enumerate(entry["outputs"]))
            want = "carry.0, carry.1, ..."
        elif s == n_stages - 1:
            want = [f"output.{j}" for j in range(n_out)]
            ok = entry["outputs"] == want and not entry["boundary_out"]
        else:
            want = [f"boundary.{n}" for n in entry["boundary_out"]]
            ok = bool(want) and entry["outputs"] == want
        if not ok:
            refuse(f"{where} part {p} outputs {entry['outputs']}, expected {want}")


def check_worker_graphs(doc: dict[str, Any], root: Path) -> None:
    """Every part's graph declares the inputs and outputs ``plan.json`` names, its K/V
    rows have the buffers' types, its weights lie in its own files; token inputs' id
    ranges are recorded (as :func:`tppc.artifact.core.check.check_graphs`).

    Raises:
        ArtifactError: naming the part's file, the value and what ``plan.json`` says.
    """
    sig = doc["signature"]
    for worker in doc["workers"]:
        for p, entry in enumerate(worker["parts"]):
            graph = read_graph(root / entry["file"])
            where = f"stage {worker['stage']} rank {worker['rank']} part {p} ({entry['file']})"
            same_names(where, "inputs", sorted(graph.inputs),
                        sorted(i["name"] for i in entry["inputs"]))
            same_names(where, "outputs", list(graph.outputs),
                        [*entry["outputs"], *(f"kv.{b['name']}" for b in entry["buffers"])])
            for b in entry["buffers"]:
                got = graph.outputs[f"kv.{b['name']}"]
                if got.dtype != b["dtype"]:
                    refuse(f"{where} output 'kv.{b['name']}' is {got.dtype}, its buffer "
                            f"{b['dtype']}")
            if entry["outputs"] and entry["outputs"][0].startswith("output."):
                check_model_outputs(where, entry, sig, graph.outputs)
            check_external(graph, entry, doc["files"], where)
            record_id_ranges(graph, entry, sig)
            if entry.get("positional_file"):
                positional = read_graph(root / entry["positional_file"])
                check_external(positional, entry, doc["files"], where)
