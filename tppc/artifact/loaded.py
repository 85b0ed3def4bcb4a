"""A loaded artifact with the call surface of :class:`tppc.CompiledPipeline` (no torch).

Terms:
    runner: :class:`LoadedPipeline`. ``runner(*args, **inputs)`` binds the inputs to the
        exported signature (names, dtypes, shapes; only the sequence axes vary and the
        length must be an exported one), runs the chunks through the ORT stages in
        pipelined threads and returns the model's output structure with numpy arrays
        (HF ModelOutputs become :class:`Outputs`, a dict with attribute access).
        ``runner.generate`` is greedy decoding like ``CompiledPipeline.generate``: a
        pipelined prefill, then one-token chunks through every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tppc.artifact.check import check_timeout, check_token_ids
from tppc.backends.onnxruntime import (
    OrtCall,
    OrtStage,
    default_threads,
    run_pipeline,
    run_serial,
)
from tppc.errors import RuntimeInputError
from tppc.generation import DEFAULT, check_max_new_tokens, stop_tokens

__all__ = ["LoadedPipeline", "Outputs"]



class Outputs(dict):
    """A model's named outputs (what HF's ModelOutput is): ``out.logits``, ``out["logits"]``
    and ``out[0]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


class LoadedPipeline:
    """The runner of a verified artifact (see the module docstring).

    Attributes:
        plan: the ``plan.json`` document.
        lengths: the exported sequence lengths.
        stages: one :class:`tppc.backends.onnxruntime.OrtStage` per stage (only stage
            ``only`` when given: a rank of a distributed job).
        last_trace: ``(stage, chunk, start, end)`` of every job of the last call.
    """

    def __init__(self, doc: dict[str, Any], root: Path, *, providers: list[Any] | None,
                 threads: int | None, only: int | None = None) -> None:
        self.plan = doc
        self.signature = doc["signature"]
        self.lengths = tuple(sorted(int(n) for n in doc["lengths"]))
        threads = threads or default_threads(len(doc["stages"]))
        entries = doc["stages"] if only is None else [doc["stages"][only]]
        self.stages = tuple(OrtStage(e, root, self.signature, threads, providers)
                            for e in entries)  # sessions are created one at a time
        self.threads_per_stage = threads
        self.last_trace: list[tuple[int, int, float, float]] = []
        gen = self.signature["generate"]
        self.eos_token_id, self.pad_token_id = gen.get("eos_token_id"), gen.get("pad_token_id")

    def chunks(self, length: int) -> tuple[tuple[int, int], ...]:
        """The chunks of an exported length."""
        found = self.plan["lengths"].get(str(length))
        if found is None:
            raise RuntimeInputError(
                f"the sequence has {length} tokens; this artifact was exported for lengths "
                f"{list(self.lengths)}. fix: export with lengths=[..., {length}]")
        return tuple((int(a), int(b)) for a, b in found)

    def __call__(self, *args: Any, **inputs: Any) -> Any:
        """Run the pipeline; returns what the model returns (numpy arrays)."""
        return self.run(args, inputs)

    def run(self, args: Sequence[Any], inputs: dict[str, Any] | None = None, *,
            timeout: float | None = None) -> Any:
        """``model(*args, **inputs)`` through the ORT stages (``timeout`` in seconds)."""
        check_timeout(timeout)
        flat, length = self.bind(args, inputs or {})
        call = self._call(flat, self.chunks(length), length, length)
        leaves = Assembler(self.signature["outputs"], length)
        self.last_trace = []
        run_pipeline(self.stages, call, leaves, timeout=timeout, trace=self.last_trace)
        return unflatten(self.signature["out_spec"], iter(leaves.leaves))

    def bind(self, args: Sequence[Any], inputs: dict[str, Any]) -> tuple[list[Any], int]:
        """Check inputs against the signature; returns the flat inputs and the length.

        Raises:
            RuntimeInputError: naming the input, what it is, what was exported, the fix.
        """
        specs = self.signature["inputs"]
        names = [e["name"] for e in specs]
        if len(args) > len(names):
            raise RuntimeInputError(f"{len(args)} positional inputs, the model takes "
                                    f"{names}. fix: pass at most {len(names)}")
        given = dict(zip(names, args))
        for name, value in inputs.items():
            if name not in names:
                raise RuntimeInputError(f"unknown input {name!r}; the exported model takes "
                                        f"{names}. fix: rename it")
            if name in given:
                raise RuntimeInputError(f"input {name!r} given twice (positionally and by "
                                        "name)")
            given[name] = value
        flat, lengths = [], {}
        for spec in specs:
            name = spec["name"]
            if "value" in spec:
                value = given.get(name, spec["value"])
                if value != spec["value"]:
                    raise RuntimeInputError(f"input {name!r} is {value!r}, exported with "
                                            f"{spec['value']!r}. fix: pass {spec['value']!r}")
                flat.append(value)
                continue
            if name not in given:
                raise RuntimeInputError(f"input {name!r} is missing. fix: pass {name}=<"
                                        f"{spec['dtype']} array of shape {spec['shape']}>")
            array = _check_array(name, given[name], spec)
            for axis in spec["seq_axes"]:
                lengths[name] = int(array.shape[axis])
            flat.append(array)
        if len(set(lengths.values())) != 1:
            raise RuntimeInputError(f"sequence inputs disagree in length: {lengths}. fix: "
                                    "give every sequence input the same number of tokens")
        return flat, next(iter(lengths.values()))

    def generate(self, input_ids: Any, max_new_tokens: int = 20, *,
                 eos_token_id: Any = DEFAULT, pad_token_id: Any = DEFAULT) -> np.ndarray:
        """Greedy decoding (HF's ``generate(do_sample=False)`` rule); returns prompt + new ids.

        The prompt length must be an exported length; decoding steps are one-token chunks.
        """
        gen = self.signature["generate"]
        token, logits_at = gen.get("token_input"), gen.get("logits_output")
        if token is None or logits_at is None:
            raise RuntimeInputError("generate needs one token-id input and a per-token "
                                    "output (logits); this artifact has neither")
        check_max_new_tokens(max_new_tokens)
        eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=self.eos_token_id,
                                   model_pad=self.pad_token_id)
        name = self.signature["inputs"][token]["name"]
        flat, prompt = self.bind((), {name: input_ids})
        total = prompt + max_new_tokens
        ids = np.zeros((flat[token].shape[0], total), dtype=flat[token].dtype)
        ids[:, :prompt] = flat[token]
        flat[token] = ids
        call = self._call(flat, self.chunks(prompt), total, total)
        last: dict[int, list[np.ndarray]] = {}
        run_pipeline(self.stages, call, lambda i, out: last.update({0: out}))
        logits = last[0][logits_at]
        unfinished = np.ones(ids.shape[0], dtype=bool)
        length = prompt
        while True:
            new = logits[:, -1].astype(np.float32).argmax(axis=-1)
            if pad is not None:
                new = np.where(unfinished, new, pad)
            ids[:, length] = new
            length += 1
            if eos_ids:
                unfinished &= ~np.isin(new, eos_ids)
            if length == total or not unfinished.any():
                break
            call.chunks = ((length - 1, length),)
            run_serial(self.stages, call, lambda i, out: last.update({0: out}))
            logits = last[0][logits_at]
        return ids[:, :length].copy()

    def _call(self, flat: list[Any], chunks: tuple[tuple[int, int], ...], seq_len: int,
              capacity: int) -> OrtCall:
        call = OrtCall(flat=flat, chunks=chunks, seq_len=seq_len, pos_len=capacity)
        for stage in self.stages:
            stage.allocate(call, capacity)
        return call


def _check_array(name: str, value: Any, spec: dict[str, Any]) -> np.ndarray:
    array = np.asarray(value)
    want = spec["shape"]
    if array.dtype != np.dtype(spec["dtype"]) or array.ndim != len(want):
        raise RuntimeInputError(
            f"input {name!r} is {array.dtype} of rank {array.ndim}, exported for "
            f"{spec['dtype']} of rank {len(want)}. fix: pass a {spec['dtype']} array of "
            f"shape {want} (null: any number of tokens)")
    for axis, (got, size) in enumerate(zip(array.shape, want)):
        if size is not None and got != size:
            raise RuntimeInputError(
                f"input {name!r} has size {got} on axis {axis} (shape {array.shape}), "
                f"exported for {size}. fix: pass shape {want} (null: any number of tokens)")
    check_token_ids(name, array, spec.get("ids_below"))
    return array


class Assembler:
    """Writes each chunk's outputs into full-length outputs (a sink)."""

    def __init__(self, outputs: list[dict[str, Any]], length: int) -> None:
        self.axes = [o["axis"] for o in outputs]
        self.length = length
        self.leaves: list[Any] = [None] * len(self.axes)
        self.offset = 0

    def __call__(self, index: int, values: list[np.ndarray]) -> None:
        size = 0
        for j, (axis, value) in enumerate(zip(self.axes, values)):
            if axis is None:
                self.leaves[j] = value
                continue
            if self.leaves[j] is None:
                shape = list(value.shape)
                shape[axis] = self.length
                self.leaves[j] = np.empty(shape, dtype=value.dtype)
            size = value.shape[axis]
            target = [slice(None)] * value.ndim
            target[axis] = slice(self.offset, self.offset + size)
            self.leaves[j][tuple(target)] = value
        self.offset += size


def unflatten(tree: dict[str, Any], leaves: Any) -> Any:
    kind = tree["type"]
    if kind == "leaf":
        return next(leaves)
    children = [unflatten(c, leaves) for c in tree["children"]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        return dict(zip(tree["keys"], children))
    return Outputs(zip(tree["keys"], children))
