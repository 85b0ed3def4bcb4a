"""A loaded artifact with the call surface of :class:`tppc.CompiledPipeline` (no torch).

Terms:
    runner: :class:`LoadedPipeline`. ``runner(*args, **inputs)`` binds the inputs to the
        exported signature (names, dtypes, shapes; only the sequence axes vary and the
        length must be an exported one), runs the chunks through the ORT stages in
        pipelined threads and returns the model's output structure with numpy arrays
        (HF ModelOutputs become :class:`Outputs`, a dict with attribute access).
        ``runner.generate`` is greedy decoding like ``CompiledPipeline.generate``: a
        pipelined prefill, then one-token chunks through every stage.
    actions: what each stage computes for a call (:mod:`tppc.program.schedule`), derived
        at load time from ``plan.json``'s chunks (every stage runs every chunk in order, the
        flow shop the plan simulated); both ONNX Runtime loops follow them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tppc.artifact.core.assemble import Assembler, Outputs, unflatten
from tppc.artifact.core.check import check_finite, check_timeout, check_token_ids
from tppc.artifact.core.check_workers import layout
from tppc.artifact.core.epilogue import OrtTail
from tppc.artifact.core.generate_inputs import check_memory, grown_ids
from tppc.backends.onnxruntime import (
    OrtCall,
    OrtStage,
    OrtWorker,
    default_threads,
    run_pipeline,
    run_serial,
)
from tppc.errors import RuntimeInputError
from tppc.generation import DEFAULT, ArrayOps, check_max_new_tokens, greedy_decode, stop_tokens
from tppc.program.actions import Actions, flow_shop
from tppc.program.sharded import sharded_lists

__all__ = ["NUMPY_OPS", "LoadedPipeline", "Outputs"]

NUMPY_OPS = ArrayOps(
    pick=lambda logits, ids: logits[:, -1].astype(np.float32).argmax(axis=-1),
    isin=lambda tokens, eos: np.isin(tokens, eos),
    where=lambda keep, tokens, pad: np.where(keep, tokens, pad),
    trues=lambda ids: np.ones(ids.shape[0], dtype=bool))
"""The decode loop's array operations on numpy arrays."""

class LoadedPipeline:
    """The runner of a verified artifact (see the module docstring).

    Attributes:
        plan: the ``plan.json`` document.
        lengths: the exported sequence lengths.
        stages: one :class:`tppc.backends.onnxruntime.OrtStage` per stage (only stage
            ``only`` when given: a rank of a distributed job); with tensor-parallel stages
            one :class:`tppc.backends.onnxruntime.OrtWorker` per worker (its parts' sessions).
        stage_of: the stage of each worker (empty: one worker per stage).
        last_trace: ``(stage, chunk, start, end)`` of every job of the last pipelined run (a
            call, or the prefill of ``generate``).
    """

    def __init__(self, doc: dict[str, Any], root: Path, *, providers: list[Any] | None,
                 threads: int | None, only: int | None = None) -> None:
        self.plan = doc
        self.signature = doc["signature"]
        self.lengths = tuple(sorted(int(n) for n in doc["lengths"]))
        workers = doc.get("workers") or []
        threads = threads or default_threads(len(doc["stages"]) or len(workers))
        entries = doc["stages"] if only is None else [doc["stages"][only]]
        self.stages: tuple[Any, ...] = tuple(
            OrtStage(e, root, self.signature, threads, providers) for e in entries) or tuple(
            OrtWorker(w, root, self.signature, threads, providers) for w in workers)
        """(sessions are created one at a time)"""
        self._layout = layout(doc) if workers else None
        self.stage_of: tuple[int, ...] = self._layout[0] if self._layout else ()
        rest = [e.get("rest") for e in entries]
        self.rest_stages = tuple(OrtStage(e, root, self.signature, threads, providers, "rest")
                                 for e in rest) if rest and all(rest) else None
        """The stages of a step's later chunks (joint attention: no text tokens), or None."""
        tail = doc.get("tail")
        self.tail = OrtTail(tail, root, threads, providers) if tail else None
        """The epilogue run after the stages (:mod:`tppc.artifact.core.epilogue`), or None."""
        self.threads_per_stage = threads
        self.actions = {c: self._lists(c) for c in (self.chunks(n) for n in self.lengths)}
        """The compute lists of each exported length's chunks (from ``plan.json``)."""
        self.last_trace: list[tuple[int, int, float, float]] = []
        gen = self.signature["generate"]
        self.eos_token_id, self.pad_token_id = gen.get("eos_token_id"), gen.get("pad_token_id")

    def actions_for(self, chunks: tuple[tuple[int, int], ...]) -> Actions:
        """The compute lists of a call with ``chunks``: an exported length's own, or (a
        decoding step) every chunk through every stage in order."""
        own = self.actions.get(chunks)
        return own if own is not None else self._lists(chunks)

    def _lists(self, chunks: tuple[tuple[int, int], ...]) -> Actions:
        """Every chunk through every stage in order (the workers of tensor-parallel stages:
        their parts and collectives, :func:`tppc.program.sharded.sharded_lists`)."""
        if self._layout is None:
            return flow_shop(chunks, len(self.plan["stages"]))
        stage_of, parts, joins = self._layout
        return sharded_lists(chunks, 1, stage_of, parts, joins)

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
        """``model(*args, **inputs)`` through the ORT stages (``timeout`` in seconds).

        The call algorithm of a loaded artifact, in one process or on every rank of a job
        (whose runner overrides :meth:`_share`, :meth:`_execute` and :meth:`_gather`): bind
        the inputs, the chunks of their length, each stage's state, run the chunks, assemble
        the outputs, the model's output structure.
        """
        check_timeout(timeout)
        flat, length = self._share(lambda: self.bind(args, inputs or {}))
        call = self._call(flat, self.chunks(length), length, length)
        leaves = Assembler(self.signature["outputs"], length)
        self._execute(call, leaves, timeout)
        out = self._gather(leaves.leaves)
        if out is not None and self.tail is not None:
            out = self.tail(flat, out)
        return None if out is None else unflatten(self.signature["out_spec"], iter(out))

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
        known = set(names)
        for key, item in inputs.items():
            for name, label, value in _leaves(key, item, known):
                if name not in known:
                    raise RuntimeInputError(f"unknown input {label}; the exported model "
                                            f"takes {names}. fix: rename it")
                if name in given:
                    raise RuntimeInputError(f"input {name!r} given twice (positionally and "
                                            "by name)")
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
            rows = spec.get("seq_rows") or [1] * len(spec["seq_axes"])
            for axis, per_unit in zip(spec["seq_axes"], rows):
                lengths[name] = int(array.shape[axis]) // per_unit
            flat.append(array)
        if len(set(lengths.values())) != 1:
            raise RuntimeInputError(f"sequence inputs disagree in length: {lengths}. fix: "
                                    "give every sequence input the same number of tokens")
        return flat, next(iter(lengths.values()))

    def denoise(self, latents: Any, scheduler: Any, num_inference_steps: int | None = 20, *,
                warmup_steps: int | None = 1, patches: int | None = None,
                model_kwargs: dict[str, Any] | None = None, timestep_arg: str = "timestep",
                output_transform: Callable[[Any], Any] | None = None, timesteps: Any = None,
                sigmas: Any = None, mu: float | None = None,
                timestep_transform: Callable[[Any], Any] | None = None) -> Any:
        """PipeFusion denoising through the ORT stages, as ``CompiledPipeline.denoise``
        (same arguments and result; ``patches=None``: the exported length's chunks):
        ``latents`` a torch tensor, ``scheduler`` a diffusers scheduler. Imports torch
        (:mod:`tppc.artifact.torch_runners.denoise`): diffusers' schedulers run on torch tensors."""
        if self.stage_of:
            raise RuntimeInputError("denoise on an artifact with tensor-parallel stages: its "
                                    "patches run unsharded stages only. fix: export the "
                                    "pipeline with tensor_parallel=1 to denoise it")
        from tppc.artifact.torch_runners.denoise import denoise_loaded
        from tppc.pipefusion.denoise import TimestepSchedule

        schedule = TimestepSchedule(timesteps=timesteps, sigmas=sigmas, mu=mu,
                                    timestep_transform=timestep_transform)
        return denoise_loaded(self, latents, scheduler, num_inference_steps,
                              warmup_steps=warmup_steps, patches=patches,
                              model_kwargs=model_kwargs, timestep_arg=timestep_arg,
                              output_transform=output_transform, schedule=schedule)

    def generate(self, input_ids: Any, max_new_tokens: int = 20, *,
                 eos_token_id: Any = DEFAULT, pad_token_id: Any = DEFAULT
                 ) -> np.ndarray | None:
        """Greedy decoding (HF's ``generate(do_sample=False)`` rule); returns prompt + new ids.

        The prompt length must be an exported length; decoding steps are one-token chunks
        (:func:`tppc.generation.greedy_decode`). A block scan (``seq_rows`` k > 1): any
        prompt length, each step re-runs its current block of k rows and puts the carried
        states back until the block completes (:mod:`tppc.pipeline.block_generate`). On a
        job: collective, rank 0's ``input_ids``, the last rank's tokens broadcast, None on
        ranks that keep no results.
        """
        gen = self.signature["generate"]
        token, logits_at = gen.get("token_input"), gen.get("logits_output")
        block = 1 if token is None else max(self.signature["inputs"][token].get("seq_rows")
                                            or [1])

        def check() -> tuple[list[Any], int]:
            if token is None or logits_at is None:
                raise RuntimeInputError("generate needs one token-id input and a per-token "
                                        "output (logits); this artifact has neither")
            check_max_new_tokens(max_new_tokens)
            check_memory(self.stages, input_ids, max_new_tokens, block)  # before it grows
            ids = input_ids if block == 1 else grown_ids(input_ids, max_new_tokens, block)
            return self.bind((), {self.signature["inputs"][token]["name"]: ids})

        given = np.shape(input_ids)[-1] if input_ids is not None and np.ndim(input_ids) else 0
        (flat, length), (new, prompt) = self._share(check, extra=(max_new_tokens, given))
        eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=self.eos_token_id,
                                   model_pad=self.pad_token_id)
        if block > 1:  # the grown ids: ``length`` whole blocks, ``prompt`` tokens given
            if gen.get("length_tables"):
                raise RuntimeInputError(
                    "generate runs whole blocks of a block scan, and the positional values "
                    f"{gen['length_tables'][:4]} depend on the whole length (a dynamic-NTK or "
                    "longrope rope): a block's filler rows would count in it. fix: export the "
                    "model loaded without the rope scaling (exact up to "
                    "max_position_embeddings); calls are exact at any exported length")
            ids = flat[token]
            step = self._block_steps(flat, length, prompt, block, logits_at)
        else:
            prompt = length
            ids = np.zeros((flat[token].shape[0], prompt + new), dtype=flat[token].dtype)
            ids[:, :prompt] = flat[token]
            flat[token] = ids
            call = self._call(flat, self.chunks(prompt), prompt + new, prompt + new)
            per_step = bool(gen.get("length_tables"))
            reset = gen.get("cache_reset") if per_step else None

            def step(n: int) -> np.ndarray | None:
                """The prefill (``n == prompt``) or one decoding step; the logits (None on
                a rank of a job without them). Positional values that depend on the whole
                length (``generate.length_tables``: a dynamic-NTK rope) are evaluated at
                each step's length, as a model with a K/V cache computes them; at
                ``generate.cache_reset`` tokens (Phi-3's longrope) the whole sequence runs
                again, as transformers' generate runs it without its cache."""
                last: list[list[np.ndarray]] = []
                serial = n > prompt
                if n > prompt and n == reset:
                    serial = n not in self.lengths
                    call.chunks = ((0, n),) if serial else self.chunks(n)
                elif n > prompt:
                    call.chunks = ((n - 1, n),)
                if per_step:
                    call.seq_len = call.pos_len = n
                    call.positional.clear()
                self._execute(call, lambda i, out: last.append(out), None, step=serial)
                return last[-1][logits_at] if last else None

        length = greedy_decode(ids[:, :prompt + new], prompt, step, NUMPY_OPS, eos_ids=eos_ids,
                               pad=pad, share=self._token_share(ids))
        return ids[:, :length].copy() if self._keeps_results() else None

    def _block_steps(self, flat: list[Any], units: int, prompt: int, block: int,
                     logits_at: int) -> Callable[[int], np.ndarray | None]:
        """``step(n)`` of a block scan's generate (:meth:`generate`): the prompt's whole
        blocks (pipelined when an exported length), then block steps at ``n − 1``."""
        ids = flat[self.signature["generate"]["token_input"]]
        call = self._call(flat, (), units, units)
        states = {b["name"] for st in self.stages for part in getattr(st, "parts", (st,))
                  for b in part.buffers if b.get("kind") == "state"}

        def run(chunks: tuple[tuple[int, int], ...], serial: bool) -> np.ndarray | None:
            last: list[list[np.ndarray]] = []
            call.chunks = chunks
            self._execute(call, lambda i, out: last.append(out), None, step=serial)
            return last[-1][logits_at] if last else None

        def block_step(p: int) -> np.ndarray | None:
            b, row = divmod(p, block)
            ids[:, p + 1:(b + 1) * block] = ids[:, p:p + 1]  # filler: the last real token
            saved = [(a, a.copy()) for name, a in call.buffers.items() if name in states] \
                if row < block - 1 else []
            logits = run(((b, b + 1),), True)
            for array, copy in saved:  # an incomplete block: its states stay its start's
                array[...] = copy
            return None if logits is None else logits[:, row:row + 1]

        def step(n: int) -> np.ndarray | None:
            if n > prompt:
                return block_step(n - 1)
            whole, logits = n // block, None
            if whole:
                logits = run(self.chunks(whole) if whole in self.lengths else ((0, whole),),
                             whole not in self.lengths)
            return logits if n % block == 0 else block_step(n - 1)

        return step

    # -- what a job's runner overrides ------------------------------------------------------------
    def _share(self, bind: Callable[[], tuple[list[Any], int]], extra: Any = None) -> Any:
        """The bound inputs ``(flat, length)``, or ``((flat, length), extra)`` when ``extra``
        is given (a job: rank 0's, on every rank)."""
        shared = bind()
        return shared if extra is None else (shared, extra)

    def _execute(self, call: OrtCall, sink: Callable[[int, list[np.ndarray]], None],
                 timeout: float | None, *, step: bool = False) -> None:
        """Every chunk of ``call`` through the stages: pipelined in threads (traced in
        :attr:`last_trace`), or in order in this thread for a decoding ``step``."""
        actions = self.actions_for(call.chunks)
        if step:
            run_serial(self.stages, call, sink, actions, timeout, self.stage_of)
            return
        self.last_trace = []
        run_pipeline(self.stages, call, sink, actions=actions, timeout=timeout,
                     trace=self.last_trace, stage_of=self.stage_of)

    def _gather(self, leaves: list[Any]) -> list[Any] | None:
        """The output leaves this process returns (a job: the last rank's, on rank 0)."""
        return leaves

    def _token_share(self, ids: np.ndarray) -> Callable[[Any], Any] | None:
        """The token broadcast of a job (None here: one process picks its own tokens)."""
        return None

    def _keeps_results(self) -> bool:
        """Whether this process returns results (a job's other ranks return None)."""
        return True

    def _call(self, flat: list[Any], chunks: tuple[tuple[int, int], ...], seq_len: int,
              capacity: int) -> OrtCall:
        call = OrtCall(flat=flat, chunks=chunks, seq_len=seq_len, pos_len=capacity)
        for stage in self.stages:
            stage.allocate(call, capacity)
        return call


def _leaves(name: str, value: Any, known: set[str], label: str | None = None
            ) -> list[tuple[str, str, Any]]:
    """``(flat name, how the caller wrote it, value)`` of one keyword input: a dict, tuple or
    list the model takes as one argument (PixArt's ``added_cond_kwargs``, HunyuanDiT's
    ``image_rotary_emb``) is given as the model takes it and named as torch.export flattens
    it (``added_cond_kwargs_resolution``, ``image_rotary_emb_0``); ``None`` in it is no
    input (torch.export keeps none)."""
    label = repr(name) if label is None else label
    if name in known or not isinstance(value, dict | list | tuple):
        return [(name, label, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [leaf for key, item in items if item is not None
            for leaf in _leaves(f"{name}_{key}", item, known, f"{label}[{key!r}]")]


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
    check_finite(name, array)
    return array
