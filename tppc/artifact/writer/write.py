"""Ahead-of-time artifacts: write a compiled pipeline as ``plan.json`` + one ONNX file per stage.

Terms:
    artifact: a directory holding ``plan.json`` (schema :data:`SCHEMA`) and, per stage, its
        export graph (``stage_<s>.onnx``, weights in ``stage_<s>.onnx.data`` when large) and
        its positional program (``stage_<s>.positional.onnx``), and with joint attention
        the stage of a step's later chunks (``stage_<s>.rest.onnx``, its entry under the
        stage's ``rest``: no text tokens; ``denoise``'s later patches). Each stage file holds only
        that stage's weights; chunk start and size are inputs, so one file serves every
        chunk of every exported length.
    exported length: a sequence length whose chunk boundaries ``plan.json`` records (the
        placement, i.e. which layers each stage runs, is the first length's for all).
    epilogue: a program's ``global`` tail (a DiT's unpatchify when the capture cannot
        follow the token axis through it, a pooling) as ``tail.onnx``, run once per call
        after the stages on the full-length outputs (``plan.json["tail"]``; null without).

``plan.json`` also holds the wiring of every stage (what feeds each input, which outputs
are boundary values, model outputs, new K/V rows or new carried states), the buffer specs
(K/V, and the state buffers of recurrent layers: kind ``state``, shape ``[2, ...]``), the model's
input/output signature as JSON (no pickle) and the sha256 and size of every file.
:func:`tppc.artifact.core.load.load` verifies all of it before it loads anything.

Example:
    >>> cp = tppc.compile(model, (ids,), cluster="2xcpu")                  # doctest: +SKIP
    >>> tppc.export(cp, "out/", lengths=[128, 256])
    >>> runner = tppc.load("out/"); runner(ids)["logits"].shape
"""

from __future__ import annotations

import json
import operator
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import onnx
import torch

from tppc.artifact.core.load import SCHEMA, plan_digest, sha256_file
from tppc.artifact.writer.export_check import check_export
from tppc.artifact.writer.graphs import ExportError, export_stage_graph
from tppc.artifact.writer.sharded import write_workers
from tppc.artifact.writer.signature import model_signature
from tppc.artifact.writer.to_onnx import OPSET, to_onnx
from tppc.backends.torch_distributed import token_axes as _token_axes
from tppc.driver.emit import build_program
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.version import __version__

__all__ = ["EXTERNAL_DATA_BYTES", "ExportError", "export", "rest_program"]

EXTERNAL_DATA_BYTES = 1 << 28
"""A stage whose weights exceed this (256 MiB) keeps them in ``stage_<s>.onnx.data``."""

Progress = Callable[[str], None]


def export(compiled: Any, path: str | os.PathLike[str], *, format: str = "onnx",
           lengths: Iterable[int] | None = None, external_data: bool | None = None,
           progress: Progress | None = None, verify: bool | None = None,
           example: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Path:
    """Write ``compiled`` (a :class:`tppc.CompiledPipeline`) as an artifact directory.

    Args:
        compiled: the pipeline (its planned length's placement is exported).
        path: the directory (created; files of an earlier export are overwritten).
        format: ``"onnx"`` (the only format).
        lengths: sequence lengths whose chunk boundaries to record (default: the planned
            length); lengths tppc did not plan are planned now (or refused for a given plan).
        external_data: weights in a ``.data`` file next to each stage (default: when a
            stage's weights exceed :data:`EXTERNAL_DATA_BYTES`).
        progress: called with one line per stage written, one with the digest of
            ``plan.json`` (``tppc.load(path, expected_sha256=...)``), and one for the check.
        verify: run the artifact with ONNX Runtime on the example and compare it with the
            torch program, the captured graph and the eager model
            (:mod:`tppc.artifact.writer.export_check`); default: the compile's ``verify``.
        example: ``(args, kwargs)`` of that check (default: the compile's example,
            ``compiled.example``; none: not checked).

    Raises:
        ExportError: an unknown format, a length that is not an int ≥ 1, or an op the
            ONNX translation does not support (naming the node).
        SoundnessError: the artifact's output differs (the files stay written); the message
            names the ONNX stage and the output.

    An export that raises (or is interrupted) removes the files it created and the directory
    when it created it; files of an earlier export it overwrote stay, refused by
    :func:`tppc.load` by their hashes.
    """
    wanted_lengths = _check_lengths(lengths)
    if format != "onnx":
        raise ExportError(f"format={format!r}: tppc exports 'onnx' only. fix: format='onnx'")
    out = Path(path)
    made = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    try:
        _export(compiled, out, wanted_lengths, external_data, progress)
    except BaseException:
        for entry in set(out.iterdir()) - before:
            if entry.is_file():
                entry.unlink(missing_ok=True)
        for folder in made:  # innermost first; only if empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    if progress is not None:
        progress(f"plan.json sha256 {plan_digest(out)} (tppc.load(..., expected_sha256=) "
                 "refuses any other artifact)")
    verify = bool(compiled.options.verify) if verify is None else verify
    example = example if example is not None else getattr(compiled, "example", None)
    if verify and example is not None:  # the files stay written when the check fails
        checked = check_export(compiled, out, *example)
        if progress is not None:
            progress(checked.summary())
    return out


def _export(compiled: Any, out: Path, wanted_lengths: list[int], external_data: bool | None,
            progress: Progress | None) -> None:
    program = compiled.program(compiled.plan.seq_len)
    states = [b for st in program.stages for b in st.buffers if b.kind == "state"]
    if states and program.workers:
        raise ExportError(
            f"{compiled.model_name} has recurrent layers (a scan, causal convolution or block "
            f"scan whose chunks carry a state: {states[0].attention} of layer "
            f"{states[0].layer!r}, {len(states)} in all) and tensor-parallel stages; tppc "
            "exports carried states of unsharded stages only. fix: compile with "
            "tensor_parallel=1 to export it")
    _check_frames(program)
    wanted = sorted({*wanted_lengths, program.seq_len})
    chunks = {str(n): [list(c) for c in compiled.program(n).chunks] for n in wanted}
    files: dict[str, dict[str, Any]] = {}
    stages: list[dict[str, Any]] = []
    workers = write_workers(program, out, files, progress, _write_stage, external_data) \
        if program.workers else []
    for stage in () if workers else program.stages:
        t0 = time.perf_counter()
        entry = _write_stage(stage, program, out, external_data, files)
        stages.append(entry)
        if progress is not None:
            size = sum(files[f]["size"] for f in entry["files"])
            progress(f"stage {stage.index}: {len(stage.layers)} layers "
                     f"({stage.layers[0]} .. {stage.layers[-1]}), {stage.param_count:,} "
                     f"parameters, {size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s")
    rest = rest_program(compiled, program)
    if rest is not None and workers:
        raise ExportError("a joint-attention model (a step's later chunks without the text "
                          "tokens) with tensor-parallel stages: tppc exports its later "
                          "chunks unsharded only. fix: compile with tensor_parallel=1 to "
                          "export it")
    for entry, stage in zip(stages, rest.stages if rest is not None else ()):
        entry["rest"] = _write_stage(stage, rest, out, external_data, files, ".rest")
    tail = _write_tail(program, out, files)
    if progress is not None and tail is not None:
        progress(f"epilogue: {tail['file']} (run once per call on the whole outputs)")
    doc = {
        "schema": SCHEMA,
        "tppc_version": __version__,
        "model": compiled.model_name,
        "format": "onnx",
        "opset": OPSET,
        "cluster": str(compiled.options.cluster),
        "placement": [{"stage": s.index, "device": s.device_name, "device_index":
                       s.device_index, "layers": [s.layer_start, s.layer_end]}
                      for s in program.plan.stages],
        "lengths": chunks,
        "signature": model_signature(compiled, program),
        "stages": stages,
        "workers": workers,
        "groups": [[name, list(members)] for name, members in program.groups],
        "tail": tail,
        "files": files,
    }
    tmp = out / "plan.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "plan.json")


def _check_frames(program: Any) -> None:
    """Refuse video latents of several frames: a chunk is a band of rows in every frame
    (several blocks of the token axis), and the ONNX runner writes one block per chunk."""
    for stage in program.stages:
        for name, spec in stage.inputs:
            if spec.frames > 1:
                raise ExportError(
                    f"stage {stage.index}'s input {name!r} holds {spec.frames} video frames "
                    "(a chunk is a band of rows in every frame); tppc's ONNX runner writes "
                    "one block of rows per chunk. fix: export a latent of one frame, or run "
                    "the torch backend")


def rest_program(compiled: Any, program: Any) -> Any:
    """The program of the chunks after the first of a step in a model with a prefix segment
    (joint attention: only image tokens, the text carried by the first chunk; what
    ``cp.denoise`` runs for the later patches), on ``program``'s placement; None without
    one."""
    front = compiled._front
    rest_gm = front.chunk.meta.get(REST_CHUNK)
    if rest_gm is None:
        return None
    return build_program(rest_gm, front.ctx, program.plan, program.chunks,
                         compiled.options.devices)


def _write_stage(stage: Any, program: Any, out: Path, external: bool | None,
                 files: dict[str, dict[str, Any]], variant: str = "",
                 outputs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Write one stage (or one part of a worker's shard, with its ``outputs`` named);
    returns its ``plan.json`` entry."""
    gm, kv_names = export_stage_graph(stage)
    last = not stage.boundary_out
    if outputs is None:
        outputs = tuple(f"output.{j}" for j in range(len(program.signature.output_axes))) \
            if last else tuple(f"boundary.{n}" for n in stage.boundary_out)
    model = to_onnx(gm, sym_name="chunk", name=f"stage_{stage.index}",
                    output_names=(*outputs, *kv_names))
    name = f"stage_{stage.index}{variant}.onnx"
    written = _save(model, out, name, external, stage.param_bytes)
    pos_name: str | None = None
    pos_inputs = list(stage.positional.graph.find_nodes(op="placeholder"))
    constants = {p.name: p.meta.get("val") for p in pos_inputs
                 if not isinstance(p.meta.get("val"), torch.Tensor)}
    n_pos = _output_count(stage.positional)
    if n_pos:  # a stage that reads no positional values has no positional program
        pos_name = f"stage_{stage.index}{variant}.positional.onnx"
        pos_model = to_onnx(stage.positional, sym_name="length", constants=constants,
                            name=f"stage_{stage.index}_positional",
                            output_names=tuple(f"positional.{i}" for i in range(n_pos)))
        written += _save(pos_model, out, pos_name, False, 0)
    for f in written:
        files[f] = {"sha256": sha256_file(out / f), "size": (out / f).stat().st_size}
    return {
        "index": stage.index,
        "layers": list(stage.layers),
        "file": name,
        "positional_file": pos_name,
        "positional_inputs": [p.name for p in pos_inputs
                              if n_pos and p.name not in constants],
        "files": written,
        "inputs": [_input(n, spec) for n, spec in stage.inputs],
        "outputs": list(outputs),
        "boundary_in": list(stage.boundary_in),
        "boundary_out": list(stage.boundary_out),
        "boundary_axes": list(_token_axes(stage)),  # read by a distributed job's receiver
        "buffers": [{"name": b.name, "kind": b.kind, "attention": b.attention,
                     "layer": b.layer, "axis": b.axis, "shape": list(b.shape),
                     "dtype": str(b.dtype).removeprefix("torch."), "output": f"kv.{b.name}",
                     "scale": b.scale, "prefix": b.prefix}
                    for b in stage.buffers],
        "param_count": stage.param_count,
        "param_bytes": stage.param_bytes,
    }


def _write_tail(program: Any, out: Path, files: dict[str, dict[str, Any]]
                ) -> dict[str, Any] | None:
    """The program's ``global`` epilogue (an unpatchify, a pooling) as ``tail.onnx``: run
    once per call after the stages, on the flat inputs and the stages' full-length outputs;
    None without one."""
    if program.tail is None:
        return None
    placeholders = list(program.tail.graph.find_nodes(op="placeholder"))
    n_flat = len(placeholders) - len(program.signature.output_axes)
    constants = {p.name: p.meta.get("val") for p in placeholders[:n_flat]
                 if not isinstance(p.meta.get("val"), torch.Tensor)}
    n_out = _output_count(program.tail)
    model = to_onnx(program.tail, sym_name="length", constants=constants, name="tail",
                    output_names=tuple(f"output.{j}" for j in range(n_out)))
    written = _save(model, out, "tail.onnx", False, 0)
    for f in written:
        files[f] = {"sha256": sha256_file(out / f), "size": (out / f).stat().st_size}
    return {"file": "tail.onnx", "files": written,
            "inputs": [p.name if p.name not in constants else None
                       for p in placeholders[:n_flat]],
            "leaves": [p.name for p in placeholders[n_flat:]], "outputs": n_out}


def _check_lengths(lengths: Iterable[int] | None) -> list[int]:
    """The lengths to export as ints; each must be a whole number of tokens ≥ 1."""
    if lengths is None:
        return []
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Iterable):
        raise ExportError(f"lengths={lengths!r} must be a list of sequence lengths. fix: "
                          "e.g. lengths=[128, 256]")
    out = []
    for n in lengths:
        try:
            value = operator.index(n) if not isinstance(n, bool) else None
        except TypeError:
            value = None
        if value is None or value < 1:
            raise ExportError(f"lengths contains {n!r}; each length is a number of tokens, "
                              "an integer ≥ 1. fix: e.g. lengths=[128, 256]")
        out.append(value)
    return out


def _input(name: str, spec: Any) -> dict[str, Any]:
    return {"name": name, "kind": spec.kind, "source": spec.source, "index": spec.index,
            "axis": spec.axis, "scale": spec.scale, "prefix": spec.prefix}


def _output_count(gm: torch.fx.GraphModule) -> int:
    output = next(iter(gm.graph.find_nodes(op="output")))
    return len(output.args[0])


def _save(model: onnx.ModelProto, out: Path, name: str, external: bool | None,
          weight_bytes: int) -> list[str]:
    external = weight_bytes > EXTERNAL_DATA_BYTES if external is None else external
    target = out / name
    data = f"{name}.data"
    if (out / data).exists():
        (out / data).unlink()
    if external:
        onnx.save_model(model, str(target), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data, size_threshold=1024)
        return [name, data] if (out / data).exists() else [name]
    onnx.save_model(model, str(target))
    return [name]

