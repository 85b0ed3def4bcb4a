"""The meaning of an artifact: ``plan.json``, the stage graphs and the signature agree.

:func:`tppc.artifact.core.load.verify` checks fields, paths and hashes; this module checks that
what the files say fits together, before any ONNX Runtime session exists:

Terms:
    chain: stage 0 takes no boundary values; stage ``s + 1`` takes, in order, the boundary
        values stage ``s`` returns; the last stage returns the model's outputs, one per
        entry of the signature's ``outputs`` (so a stage removed or two stages swapped is
        refused, never run).
    declared graph: a stage graph's inputs and outputs (names, element types, shapes) as
        its ONNX file declares them (:func:`tppc.artifact.core.graph_io.read_graph`: the
        protobuf is read, the weights skipped). Exports since this check declare the
        outputs' sizes; older ones their rank only, so a boundary is then checked by type
        and rank.
    agreement: every stage input of ``plan.json`` is a graph input of the same name and
        nothing else is; its element type and static sizes match what feeds it (the
        signature's input, the K/V buffer spec, the previous stage's output, the
        positional program's output); the graph returns ``outputs`` then the new K/V rows
        in buffer order; weights kept in external files name one of that stage's files.
    id range: a token input whose ids index an embedding table (an ONNX ``Gather`` on an
        initializer) accepts ids ``0 <= id < rows``; :func:`check_graphs` records ``rows``
        as ``ids_below`` in that input's signature entry, and :func:`check_token_ids`
        refuses a call outside it (ONNX ``Gather`` would read id -1 as the last row).

Imports neither torch nor onnx.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tppc.artifact.core.graph_io import Graph, GraphIO, read_graph
from tppc.errors import ArtifactError, RuntimeInputError, SpecError

__all__ = ["check_external", "check_finite", "check_graphs", "check_model_outputs",
           "check_plan", "check_timeout", "check_token_ids", "check_wiring",
           "record_id_ranges", "refuse", "same_names"]

_FIX = "fix: re-export the artifact (plan.json and the stage files must come from one export)"
#: ONNX ops that pass token ids through unchanged on their way to the embedding's Gather.
_PASS_IDS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})
_SCALARS = ("chunk_start", "chunk_size", "seq_len")


# -- plan.json alone -------------------------------------------------------------------------
def check_plan(doc: dict[str, Any]) -> None:
    """The chain of stages, their wiring and the signature agree (no file is read).

    Raises:
        ArtifactError: naming the stage, the field, the values found and expected.
    """
    stages, sig = doc["stages"], doc["signature"]
    placement = doc.get("placement")
    if doc.get("workers"):  # tensor-parallel stages: checked by check_workers
        stages = []
    elif isinstance(placement, list) and len(placement) != len(stages):
        refuse(f"placement lists {len(placement)} stages and stages {len(stages)} (a stage "
                "was removed or added)")
    n_out = len(sig["outputs"])
    for s, entry in enumerate(stages):
        where = f"stages[{s}]"
        before = stages[s - 1]["boundary_out"] if s else []
        if entry["boundary_in"] != before:
            refuse(f"{where}.boundary_in is {entry['boundary_in']}, but "
                    + (f"stages[{s - 1}] returns {before}" if s else
                       "the first stage takes no boundary values")
                    + " (stages removed or reordered)")
        received = [i["name"] for i in entry["inputs"] if i["kind"] == "boundary"]
        if received != entry["boundary_in"]:
            refuse(f"{where} has boundary inputs {received}, its boundary_in is "
                    f"{entry['boundary_in']}")
        last = s == len(stages) - 1
        want = [f"output.{j}" for j in range(n_out)] if last else \
            [f"boundary.{n}" for n in entry["boundary_out"]]
        if last and entry["boundary_out"]:
            refuse(f"{where} is the last stage but returns boundary values "
                    f"{entry['boundary_out']} (a stage after it was removed)")
        if not last and not entry["boundary_out"]:
            refuse(f"{where} returns the model's outputs but is followed by {len(stages) - 1 - s}"
                    " more stage(s) (stages reordered)")
        if entry["outputs"] != want:
            refuse(f"{where}.outputs is {entry['outputs']}, expected {want}"
                    + (f" (the signature has {n_out} outputs)" if last else ""))
        check_wiring(entry, where, sig["inputs"])
    _check_generate(sig)
    leaves = _leaves(sig["out_spec"])
    tail = doc.get("tail")
    n_model = tail["outputs"] if tail else n_out  # an epilogue maps the stages' outputs
    if leaves != n_model:
        refuse(f"signature.out_spec has {leaves} leaves, " + (
            f"the epilogue returns {n_model}" if tail else f"signature.outputs {n_out}"))


def check_wiring(entry: dict[str, Any], where: str, sig_inputs: list[dict[str, Any]]) -> None:
    """Every input of a stage entry reads a signature input or a buffer spec it declares."""
    buffers = {b["name"]: b for b in entry["buffers"]}
    fed = set()
    for i, spec in enumerate(entry["inputs"]):
        kind, at = spec["kind"], f"{where}.inputs[{i}] ({spec['name']!r}, {spec['kind']})"
        if kind in ("token", "const"):
            index = spec["index"]
            if index is None or not 0 <= index < len(sig_inputs) \
                    or "value" in sig_inputs[index]:
                refuse(f"{at} reads signature input {index}, which is not a tensor input of "
                        f"the {len(sig_inputs)} in the signature")
            axes = sig_inputs[index]["seq_axes"]
            if kind == "token" and spec["axis"] not in axes:
                refuse(f"{at} is sliced on axis {spec['axis']}, the signature's "
                        f"{sig_inputs[index]['name']!r} has sequence axes {axes}")
        elif kind in ("key", "value", "state"):
            b = buffers.get(spec["name"])
            if b is None or b.get("kind") != kind or b["axis"] != spec["axis"]:
                refuse(f"{at} has no matching buffer spec (kind {kind}, axis {spec['axis']});"
                        f" buffers: {sorted(buffers)}")
            fed.add(spec["name"])
    for name, b in buffers.items():
        if name not in fed:
            refuse(f"{where}.buffers names {name!r}, which no input of the stage reads")
        if b.get("output", f"kv.{name}") != f"kv.{name}":
            refuse(f"{where}.buffers[{name!r}].output is {b['output']!r}, expected 'kv.{name}'")


def _check_generate(sig: dict[str, Any]) -> None:
    gen, inputs, outputs = sig["generate"], sig["inputs"], sig["outputs"]
    token, logits = gen.get("token_input"), gen.get("logits_output")
    if token is not None and not (isinstance(token, int) and 0 <= token < len(inputs)
                                  and inputs[token].get("seq_axes")):
        refuse(f"signature.generate.token_input is {token!r}, not the index of a sequence "
                f"input (the signature has {len(inputs)} inputs)")
    if logits is not None and not (isinstance(logits, int) and 0 <= logits < len(outputs)
                                   and outputs[logits]["axis"] is not None):
        refuse(f"signature.generate.logits_output is {logits!r}, not the index of a "
                f"per-token output (the signature has {len(outputs)} outputs)")


def _leaves(tree: Any) -> int:
    """Leaves of an output tree (its depth is bounded by load's parser)."""
    if not isinstance(tree, dict) or tree.get("type") not in ("leaf", "tuple", "list", "dict",
                                                              "mapping"):
        refuse(f"signature.out_spec has a node {str(tree)[:60]}, not a tree node")
    if tree["type"] == "leaf":
        return 1
    children = tree.get("children")
    keys = tree.get("keys", children)
    if not isinstance(children, list) or not isinstance(keys, list) \
            or len(keys) != len(children):
        refuse(f"signature.out_spec node {str(tree)[:60]} needs children (and keys of the "
                "same count)")
    return sum(_leaves(c) for c in children)


# -- the stage graphs --------------------------------------------------------------------------
def check_graphs(doc: dict[str, Any], root: Path, stages: Sequence[int]) -> None:
    """The declared graphs of ``stages`` agree with ``plan.json`` (see the module docstring).

    Records each token input's id range as ``ids_below`` in its signature entry.

    Raises:
        ArtifactError: naming the stage, the graph value, what it declares and what
            ``plan.json`` says.
    """
    sig = doc["signature"]
    for entry in sig["inputs"]:
        entry.pop("ids_below", None)  # derived from the graphs only, never trusted
    previous: dict[str, tuple[GraphIO, str]] | None = None
    for s in stages:
        entry = doc["stages"][s]
        graph = read_graph(root / entry["file"])
        inputs, outputs = graph.inputs, graph.outputs
        where = f"stage {s} ({entry['file']})"
        same_names(where, "inputs", sorted(inputs), sorted(i["name"] for i in entry["inputs"]))
        same_names(where, "outputs", list(outputs),
                    [*entry["outputs"], *(f"kv.{b['name']}" for b in entry["buffers"])])
        positional = _positional(doc, root, s)
        boundary = previous if s - 1 in stages else None
        for spec in entry["inputs"]:
            found = _expected(spec, sig, entry, positional, boundary)
            if found is not None:
                _agree(f"{where} input {spec['name']!r} ({spec['kind']})", inputs[spec["name"]],
                       *found, spec.get("axis") if spec["kind"] != "const" else None)
        for b in entry["buffers"]:
            _agree(f"{where} output 'kv.{b['name']}'", outputs[f"kv.{b['name']}"],
                   *_buffer_output(b), b["axis"])
        if not entry["boundary_out"]:
            check_model_outputs(where, entry, sig, outputs)
        check_external(graph, entry, doc["files"], where)
        record_id_ranges(graph, entry, sig)
        previous = {n.removeprefix("boundary."): (outputs[n], f"stage {s}'s output {n!r}")
                    for n in entry["outputs"]}


def _buffer_output(b: dict[str, Any]) -> tuple[GraphIO, str]:
    """What a stage's ``kv.<buffer>`` output must be, and where that is said: a chunk's K/V
    rows have the buffer's shape (its token axis the chunk's); a new state is one slot of
    a state buffer's ``[2, ...]``."""
    shape = tuple(b["shape"][1:]) if b.get("kind") == "state" else tuple(b["shape"])
    return GraphIO(b["dtype"], shape), f"buffers[{b['name']!r}]"


def same_names(where: str, what: str, got: list[str], want: list[str]) -> None:
    """A graph's ``got`` input or output names are ``want``, in order."""
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        detail = f"missing {missing}, unexpected {extra}" if missing or extra else \
            f"in the order {got}, plan.json says {want}"
        refuse(f"{where} declares graph {what} that do not match plan.json: {detail}")


def _positional(doc: dict[str, Any], root: Path, s: int) -> list[GraphIO]:
    entry, sig = doc["stages"][s], doc["signature"]
    name = entry.get("positional_file")
    uses = [i for i in entry["inputs"] if i["kind"] == "positional"]
    if name is None:
        if uses:
            refuse(f"stage {s} reads positional values {[i['name'] for i in uses]} but has no "
                    "positional_file")
        return []
    graph = read_graph(root / name)
    inputs, outputs = graph.inputs, graph.outputs
    same_names(f"stage {s} ({name})", "inputs", sorted(inputs),
                sorted(entry["positional_inputs"]))
    by_name = {e["name"]: e for e in sig["inputs"]}
    for n in entry["positional_inputs"]:
        e = by_name.get(n)
        if e is None or "value" in e:
            refuse(f"stage {s}.positional_inputs names {n!r}, not a tensor input of the "
                    "signature")
        _agree(f"stage {s} ({name}) input {n!r}", inputs[n], _sig_io(e), f"signature input {n!r}",
               None, seq=e["seq_axes"])
    check_external(graph, entry, doc["files"], f"stage {s} ({name})")
    return list(outputs.values())


def _sig_io(e: dict[str, Any]) -> GraphIO:
    return GraphIO(e["dtype"], tuple(e["shape"]))


def _expected(spec: dict[str, Any], sig: dict[str, Any], entry: dict[str, Any],
              positional: list[GraphIO], boundary: dict[str, tuple[GraphIO, str]] | None
              ) -> tuple[GraphIO, str] | None:
    """What feeds a stage input, and where that is said."""
    kind = spec["kind"]
    if kind in ("token", "const"):
        e = sig["inputs"][spec["index"]]
        return _sig_io(e), f"signature input {e['name']!r}"
    if kind in _SCALARS:
        return GraphIO("int64", ()), "a scalar"
    if kind in ("key", "value", "state"):
        b = next(b for b in entry["buffers"] if b["name"] == spec["name"])
        return GraphIO(b["dtype"], tuple(b["shape"])), f"buffers[{b['name']!r}]"
    if kind == "positional":
        index = spec["index"]
        if index is None or not 0 <= index < len(positional):
            refuse(f"stage {entry['index']} input {spec['name']!r} reads positional value "
                    f"{index}; the positional program returns {len(positional)}")
        return positional[index], f"positional output {index}"
    if kind == "boundary" and boundary is not None:
        return boundary[spec["name"]]
    return None


def _agree(where: str, got: GraphIO, want: GraphIO, source: str, axis: int | None, *,
           seq: Sequence[int] = ()) -> None:
    """``got`` (the graph) has the element type, rank and static sizes of ``want`` (what
    ``source`` says); ``axis`` and ``seq`` are token axes, whose size varies."""
    if got.dtype != want.dtype:
        refuse(f"{where} is {got.dtype} in the graph, {source} is {want.dtype}")
    if got.dims is None or want.dims is None:
        return
    if len(got.dims) != len(want.dims):
        refuse(f"{where} has shape {_shape(got.dims)} (rank {len(got.dims)}) in the graph, "
                f"{source} {_shape(want.dims)} (rank {len(want.dims)})")
    for a, (g, w) in enumerate(zip(got.dims, want.dims)):
        if a == axis or a in seq:
            continue
        if isinstance(g, int) and isinstance(w, int) and g != w:
            refuse(f"{where} has size {g} on axis {a} (shape {_shape(got.dims)}) in the graph, "
                    f"{source} {w} (shape {_shape(want.dims)})")


def _shape(dims: tuple[int | str | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def check_model_outputs(where: str, entry: dict[str, Any], sig: dict[str, Any],
                         outputs: dict[str, GraphIO]) -> None:
    """The last stage's model outputs have a rank that holds the signature's token axis."""
    for j, o in enumerate(sig["outputs"]):
        got = outputs[entry["outputs"][j]]
        if o["axis"] is not None and got.dims is not None and o["axis"] >= len(got.dims):
            refuse(f"{where} output 'output.{j}' has rank {len(got.dims)}; the signature "
                    f"assembles it along axis {o['axis']}")


def check_external(graph: Graph, entry: dict[str, Any], files: dict[str, Any],
                    where: str) -> None:
    """Weights in external files: a file of this stage, and inside it."""
    mine = {*entry["files"], entry["file"], entry.get("positional_file")} - {None}
    for w in graph.external:
        if w.location not in mine:
            raise ArtifactError(
                f"{where}: weight {w.name!r} is stored in {w.location!r}, which is not one of "
                f"this stage's files {sorted(mine)} (a path outside the artifact or another "
                f"stage's file). {_FIX}")
        if w.end > files[w.location]["size"]:
            refuse(f"{where}: weight {w.name!r} reads bytes up to {w.end} of {w.location}, "
                    f"which has {files[w.location]['size']}")


def record_id_ranges(graph: Graph, entry: dict[str, Any], sig: dict[str, Any]) -> None:
    """``ids_below`` of each token input that an embedding ``Gather`` reads."""
    users: dict[str, list[tuple[Any, int]]] = {}
    for node in graph.nodes:
        for i, name in enumerate(node.inputs):
            users.setdefault(name, []).append((node, i))
    for spec in entry["inputs"]:
        if spec["kind"] != "token" or sig["inputs"][spec["index"]]["dtype"] not in ("int64",
                                                                                     "int32"):
            continue
        rows, todo, seen = [], [spec["name"]], set()
        while todo:
            value = todo.pop()
            for node, i in users.get(value, ()):
                if node.op_type in _PASS_IDS and i == 0 and node.outputs[0] not in seen:
                    seen.add(node.outputs[0])
                    todo.append(node.outputs[0])
                elif node.op_type == "Gather" and i == 1 and node.inputs[0] in graph.initializers:
                    dims = graph.initializers[node.inputs[0]]
                    if -len(dims) <= node.axis < len(dims):
                        rows.append(dims[node.axis])
        if rows:
            sig["inputs"][spec["index"]]["ids_below"] = min(rows)


# -- call inputs -------------------------------------------------------------------------------
def check_token_ids(name: str, array: np.ndarray, ids_below: int | None) -> None:
    """Token ids index the embedding: ``0 <= id < ids_below`` (as torch's embedding checks).

    Raises:
        RuntimeInputError: naming the input, the first bad id and where it is, the range.
    """
    if ids_below is None or array.size == 0:
        return
    bad = (array < 0) | (array >= ids_below)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise RuntimeInputError(
            f"input {name!r} holds token id {int(array[at])} at {at}; the model's vocabulary "
            f"has ids 0..{ids_below - 1}. fix: pass ids in [0, {ids_below}) (ONNX would read "
            "a negative id from the end of the table)")


def check_finite(name: str, array: np.ndarray) -> None:
    """A floating input holding NaN is refused, as the torch path refuses it
    (:func:`tppc.frontend.front_end.check_finite`: eager and chunked attention spread a NaN
    differently).

    Raises:
        RuntimeInputError: naming the input and the first NaN's index.
    """
    if array.dtype.kind != "f" or array.size == 0:
        return
    bad = np.isnan(array)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise RuntimeInputError(
            f"input {name!r} holds NaN (first at index {at}, {int(bad.sum())} in all): "
            "masked attention spreads a NaN differently in eager and in chunks, so no "
            "result would be meaningful. fix: replace NaN before the call (e.g. "
            "numpy.nan_to_num) or find where it came from")


def check_timeout(timeout: Any) -> None:
    """A per-call ``timeout``: None, or a positive finite number of seconds (the torch
    side's rule, :func:`tppc.driver.options.check_seconds`, which a torch-free module cannot
    import; infinity is refused too: a thread cannot wait that long).

    Raises:
        SpecError: naming the value.
    """
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not 0 < timeout < math.inf:
        raise SpecError(f"timeout={timeout!r} must be a positive number of seconds. fix: e.g. "
                        "timeout=30, or timeout=None for no limit")


def refuse(what: str) -> NoReturn:
    """Raise the ArtifactError of a ``plan.json`` that disagrees with itself or its graphs."""
    raise ArtifactError(f"plan.json disagrees with itself or its stage graphs: {what}. {_FIX}")
