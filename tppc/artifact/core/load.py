"""Load an exported artifact: verify ``plan.json`` and every file, then open the stages.

Terms:
    verification: before any session is created, :func:`verify` reads ``plan.json`` with
        bounds (at most :data:`MAX_PLAN_BYTES`, nested at most :data:`MAX_DEPTH` deep),
        checks the schema version, the type of every field :mod:`tppc.backends.onnxruntime`
        reads, that every file name stays inside the directory (a bare name: no ``/``,
        ``\\``, ``..``, no absolute path, no link out), the size and sha256 of every file,
        and then the meaning (:mod:`tppc.artifact.core.check`: the chain of stages, the stage
        graphs' inputs and outputs, the signature and the buffer specs agree). Any failure
        raises :class:`ArtifactError` naming the field or file, the value and the fix;
        nothing is half-loaded.
    authenticity: the hashes catch damage, not an edit (a stage swapped for another valid
        model with ``plan.json`` hashed again passes them). ``expected_sha256``, the digest
        of ``plan.json`` that ``tppc.export`` reports (:func:`plan_digest`), pins the whole
        artifact: ``plan.json`` lists every file's sha256, so a digest that matches vouches
        for every byte loaded.

This module imports no torch (nor transformers, diffusers, onnx, pickle): a serving
machine needs numpy and onnxruntime only. ``tppc.load`` is this module's :func:`load`.

Example:
    >>> runner = load("out/", threads_per_stage=1)                          # doctest: +SKIP
    >>> runner(input_ids=ids)["logits"].shape
    (1, 128, 32000)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tppc.artifact.core.check import check_graphs, check_plan
from tppc.artifact.core.check_workers import check_worker_graphs, check_workers
from tppc.artifact.core.epilogue import check_tail
from tppc.errors import ArtifactError

__all__ = ["MAX_DEPTH", "MAX_PLAN_BYTES", "READS", "SCHEMA", "ArtifactError", "load", "plan_digest",
           "sha256_file", "verify"]

SCHEMA = "tppc.export/2"
"""The ``plan.json`` schema this tppc writes (``/2``: tensor-parallel ``workers``)."""
READS = ("tppc.export/1", SCHEMA)
"""The schemas this tppc reads (``/1``: no ``workers``, one graph per stage)."""
MAX_PLAN_BYTES = 64 << 20
"""The largest ``plan.json`` read (an export of hundreds of stages takes well under 1 MiB)."""
MAX_DEPTH = 64
"""The deepest nesting of ``plan.json`` read (an export nests about 10 deep)."""

_KINDS = {"token", "const", "full", "chunk_start", "chunk_size", "seq_len", "positional", "key",
          "value", "state", "boundary"}
_DTYPES = {"float32", "float16", "float64", "int64", "int32", "bool"}


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def plan_digest(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of an artifact's ``plan.json`` (what ``expected_sha256`` compares)."""
    return sha256_file(Path(path) / "plan.json")


def verify(path: str | os.PathLike[str], stage: int | None = None, *,
           expected_sha256: str | None = None) -> dict[str, Any]:
    """Read and check an artifact's ``plan.json`` and files; returns the document.

    With ``stage``, only that stage's files are checked on disk (a rank of a distributed
    job reads nothing else; the other files need not be present). With
    ``expected_sha256``, ``plan.json`` must have that digest (module docstring).

    Raises:
        ArtifactError: see the module docstring.
    """
    root = Path(path)
    plan_file = root / "plan.json"
    if not plan_file.is_file():
        raise ArtifactError(f"{root} has no plan.json. fix: pass the directory that "
                            "tppc.export wrote")
    doc = _read_plan(plan_file, expected_sha256)
    schema = doc.get("schema")
    if schema not in READS:
        raise ArtifactError(f"{plan_file}: schema {schema!r} is not one of {READS}, the ones "
                            "this tppc reads. fix: export again with this tppc version (or load "
                            "with the version that wrote it)")
    files = _field(doc, "files", dict)
    for name, meta in files.items():
        _safe_name(name, root)
        _check(isinstance(meta, dict) and isinstance(meta.get("sha256"), str)
               and _is_int(meta.get("size")), f"files[{name!r}]", meta,
               "{'sha256': str, 'size': int}")
    _check_lengths(_field(doc, "lengths", dict))
    _check_signature(_field(doc, "signature", dict))
    stages = _field(doc, "stages", list)
    workers = doc.setdefault("workers", [])
    _check(len(stages) > 0 or bool(workers), "stages", stages, "a non-empty list")
    check_workers(doc, lambda entry, s, where: _check_stage(entry, s, files, where))
    for s, entry in enumerate(stages):
        _check_stage(entry, s, files)
        if entry.get("rest") is not None:  # joint attention: a step's later chunks
            _check_stage(entry["rest"], s, files)
    check_tail(doc.get("tail"), files, len(doc["signature"]["inputs"]),
               len(doc["signature"]["outputs"]))
    check_plan(doc)
    if stage is not None and workers:
        raise ArtifactError("this artifact has tensor-parallel stages (plan.json 'workers'); "
                            "a distributed job runs one rank per stage and has no "
                            "collectives for them yet. fix: tppc.load(path) runs it in one "
                            "process (threads), or export with tensor_parallel=1")
    if stage is not None:
        _check(_is_int(stage) and 0 <= stage < len(stages), "stage", stage,
               f"a stage index below {len(stages)} (one rank per stage)")
        entry = stages[stage]
        tail = doc.get("tail") or {"files": []}  # the epilogue: run where results are
        rest = entry.get("rest") or {"files": []}
        mine = {*entry["files"], entry["file"], entry.get("positional_file"),
                *tail["files"], *rest["files"]} - {None}
        files = {name: files[name] for name in sorted(mine)}
    for name, meta in files.items():  # sizes first (cheap), then hashes
        file = root / name
        if not file.is_file():
            raise ArtifactError(f"{file} is missing (listed in plan.json). fix: copy the "
                                "whole artifact directory, or re-export")
        size = file.stat().st_size
        if size != meta["size"]:
            raise ArtifactError(f"{file} has {size} bytes, plan.json says {meta['size']} "
                                "(truncated or altered). fix: copy it again, or re-export")
    for name, meta in files.items():
        digest = sha256_file(root / name)
        if digest != meta["sha256"]:
            raise ArtifactError(f"{root / name}: sha256 {digest[:16]}… does not match "
                                f"plan.json's {meta['sha256'][:16]}… (altered). fix: copy it "
                                "again, or re-export")
    check_graphs(doc, root, range(len(stages)) if stage is None else [stage])
    if workers:
        check_worker_graphs(doc, root)
    return doc


def load(path: str | os.PathLike[str], *, backend: str = "onnxruntime",
         providers: list[Any] | None = None, threads_per_stage: int | None = None,
         expected_sha256: str | None = None) -> Any:
    """Verify an artifact (:func:`verify`) and return its runner.

    Args:
        path: the directory :func:`tppc.export` wrote.
        expected_sha256: the digest of its ``plan.json`` that the export reported; an
            artifact whose ``plan.json`` differs is refused (module docstring).
        backend: ``"onnxruntime"`` (the only one).
        providers: ONNX Runtime execution providers of the stage sessions (default CPU).
        threads_per_stage: intra-op threads per stage (default: cores / stages).

    Returns:
        A :class:`tppc.artifact.core.loaded.LoadedPipeline`: ``runner(*args, **inputs)`` and
        ``runner.generate(ids, max_new_tokens=...)``.
    """
    if backend != "onnxruntime":
        raise ArtifactError(f"backend={backend!r}: tppc.load runs 'onnxruntime' only. "
                            "fix: backend='onnxruntime'")
    if threads_per_stage is not None and (not _is_int(threads_per_stage)
                                          or threads_per_stage < 1):
        raise ArtifactError(f"threads_per_stage={threads_per_stage!r} must be an int ≥ 1")
    doc = verify(path, expected_sha256=expected_sha256)
    from tppc.artifact.core.loaded import LoadedPipeline

    return LoadedPipeline(doc, Path(path), providers=providers, threads=threads_per_stage)


def _read_plan(plan_file: Path, expected_sha256: str | None) -> dict[str, Any]:
    """``plan.json`` parsed within :data:`MAX_PLAN_BYTES` and :data:`MAX_DEPTH`, with the
    digest ``expected_sha256`` (of the very bytes parsed) when given."""
    if expected_sha256 is not None and not (
            isinstance(expected_sha256, str) and len(expected_sha256) == 64
            and all(c in "0123456789abcdefABCDEF" for c in expected_sha256)):
        raise ArtifactError(f"expected_sha256={expected_sha256!r} is not a sha256 digest (64 "
                            "hex digits). fix: pass the digest tppc.export reported for "
                            "plan.json")
    size = plan_file.stat().st_size
    if size > MAX_PLAN_BYTES:
        raise ArtifactError(f"{plan_file} has {size:,} bytes, more than the {MAX_PLAN_BYTES:,} "
                            "tppc reads (an export writes far less). fix: re-export")
    data = plan_file.read_bytes()
    if expected_sha256 is not None:
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected_sha256.lower():
            raise ArtifactError(f"{plan_file}: sha256 {digest} is not the expected "
                                f"{expected_sha256.lower()} (this is not the artifact that was "
                                "exported: plan.json was rewritten, or a file it lists was "
                                "swapped). fix: load the directory the export wrote, or pass "
                                "the digest it reported")
    try:
        doc = json.loads(data)
    except RecursionError:
        doc = None  # nested deeper than the parser's stack: reported as too deep below
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{plan_file} is not valid JSON ({exc}). fix: re-export") from exc
    depth = _depth(doc) if doc is not None else MAX_DEPTH + 1
    if depth > MAX_DEPTH:
        raise ArtifactError(f"{plan_file} nests deeper than {MAX_DEPTH} levels (an export "
                            "nests about 10). fix: re-export (plan.json was edited or is "
                            "damaged)")
    _check(isinstance(doc, dict), "plan.json", doc, "a JSON object")
    return doc


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        children = value.values() if isinstance(value, dict) else \
            value if isinstance(value, list) else ()
        todo.extend((c, depth + 1) for c in children)
    return deepest


# -- field checks ------------------------------------------------------------------------------
def _check(ok: bool, where: str, value: Any, want: str) -> None:
    if not ok:
        text = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
        raise ArtifactError(f"plan.json: {where} is {text}, expected {want}. fix: re-export "
                            "the artifact (plan.json was edited or is damaged)")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(obj: dict[str, Any], key: str, kind: type, where: str = "") -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    _check(isinstance(value, kind) and (kind is not int or _is_int(value)),
           f"{where}{key}", value, f"a {kind.__name__}")
    return value


def _safe_name(name: Any, root: Path) -> None:
    bad = (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
           or "\\" in name or "\0" in name or Path(name).is_absolute()
           or (root / name).resolve().parent != root.resolve())
    if bad:
        raise ArtifactError(f"plan.json names the file {name!r}, which is not a plain file "
                            f"name inside {root}. fix: re-export (paths must not escape the "
                            "artifact directory)")


def _check_lengths(lengths: dict[str, Any]) -> None:
    _check(len(lengths) > 0, "lengths", lengths, "at least one length")
    for key, chunks in lengths.items():
        _check(key.isdigit() and int(key) > 0, "lengths key", key, "a positive int")
        ok = isinstance(chunks, list) and len(chunks) > 0 and all(
            isinstance(c, list) and len(c) == 2 and all(_is_int(x) for x in c)
            for c in chunks)
        ok = ok and chunks[0][0] == 0 and chunks[-1][1] == int(key) and all(
            a < b for a, b in chunks) and all(
            chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1))
        _check(ok, f"lengths[{key!r}]", chunks, f"chunks [[0, a], [a, b], ..., [., {key}]]")


def _check_signature(sig: dict[str, Any]) -> None:
    inputs = _field(sig, "inputs", list, "signature.")
    for i, e in enumerate(inputs):
        where = f"signature.inputs[{i}]"
        _check(isinstance(e, dict) and isinstance(e.get("name"), str), where, e,
               "an object with a name")
        if "value" in e:
            continue
        _check(e.get("dtype") in _DTYPES, f"{where}.dtype", e.get("dtype"), str(_DTYPES))
        shape, seq = e.get("shape"), e.get("seq_axes")
        _check(isinstance(shape, list) and all(s is None or _is_int(s) for s in shape),
               f"{where}.shape", shape, "a list of ints and nulls")
        _check(isinstance(seq, list) and all(_is_int(a) and 0 <= a < len(shape)
                                             and shape[a] is None for a in seq),
               f"{where}.seq_axes", seq, "axes of the shape that are null")
    outputs = _field(sig, "outputs", list, "signature.")
    for j, o in enumerate(outputs):
        axis = o.get("axis") if isinstance(o, dict) else "?"
        _check(axis is None or _is_int(axis), f"signature.outputs[{j}].axis", axis,
               "an int or null")
    _field(sig, "out_spec", dict, "signature.")
    _field(sig, "generate", dict, "signature.")


def _check_stage(entry: Any, s: int, files: dict[str, Any], at: str | None = None) -> None:
    at = at or f"stages[{s}]"
    where = f"{at}."
    _check(isinstance(entry, dict), at, entry, "an object")
    _check(entry.get("index") == s, f"{where}index", entry.get("index"), str(s))
    for key in ("file", "positional_file"):
        name = entry.get(key)
        if key == "positional_file" and name is None:
            continue
        _check(isinstance(name, str) and name in files, f"{where}{key}", name,
               "a file listed in plan.json 'files'")
    for name in _field(entry, "files", list, where):
        _check(name in files, f"{where}files", name, "files listed in plan.json 'files'")
    for i, spec in enumerate(_field(entry, "inputs", list, where)):
        ok = isinstance(spec, dict) and isinstance(spec.get("name"), str) \
            and spec.get("kind") in _KINDS and (spec.get("index") is None
                                                or _is_int(spec.get("index"))) \
            and (spec.get("axis") is None or _is_int(spec.get("axis")))
        _check(ok, f"{where}inputs[{i}]", spec, f"{{name, kind in {sorted(_KINDS)}, ...}}")
    for i, b in enumerate(_field(entry, "buffers", list, where)):
        state = isinstance(b, dict) and b.get("kind") == "state"
        ok = isinstance(b, dict) and isinstance(b.get("name"), str) \
            and b.get("dtype") in _DTYPES and isinstance(b.get("shape"), list) \
            and all(x is None or _is_int(x) for x in b["shape"]) and (
                (state and b.get("axis") is None and b["shape"][:1] == [2]
                 and None not in b["shape"])
                or (not state and sum(x is None for x in b["shape"]) == 1
                    and _is_int(b.get("axis")) and b["shape"][b["axis"]] is None))
        _check(ok, f"{where}buffers[{i}]", b, "{name, dtype, shape with one null at axis} "
               "(a state: shape [2, ...] of ints, axis null)")
        _check(b.get("kind") in ("key", "value", "state"), f"{where}buffers[{i}].kind",
               b.get("kind"), "'key', 'value' or 'state'")
    for key in ("outputs", "positional_inputs", "boundary_in", "boundary_out"):
        names = _field(entry, key, list, where)
        _check(all(isinstance(n, str) for n in names), f"{where}{key}", names,
               "a list of names")
    axes = entry.get("boundary_axes", [])  # optional (older artifacts have none)
    _check(isinstance(axes, list) and all(a is None or _is_int(a) for a in axes),
           f"{where}boundary_axes", axes, "a list of ints and nulls")
