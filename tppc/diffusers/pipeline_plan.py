"""Plan a whole diffusion pipeline: text encoders, the transformer, the VAE decoder.

What users time is a pipeline call: the text encoders run before the denoising loop, the
transformer runs ``steps`` times (pipelined by tppc), the VAE decoder runs once after it.
:func:`plan_pipeline` plans the transformer as ``tppc.plan`` does, captures every other
component at the call's shapes (:func:`tppc.frontend.static_export.export_static`), prices
it with the same device constants (:func:`tppc.cost_models.call_costs.price_call`) and
places it on the cluster's device where it finishes soonest and fits beside the stages'
memory (the ``cpu`` devices of a node share one RAM: what one holds, all lose). The
prediction is the sum of the three phases (each waits for the one before) and the transfers
between them.

Example:
    >>> pp = plan_pipeline(pipe, (latent,), kwargs, cluster="4xa100-pcie",
    ...                    workload=Workload(kind="diffusion", steps=20), prompt_tokens=120,
    ...                    encoder_calls=2)                       # doctest: +SKIP
    >>> print(pp.summary())                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tppc.cost_models.call_costs import CallCost, price_call
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.node_costs import tensor_vals
from tppc.driver.planning import plan as plan_transformer
from tppc.errors import PlanInfeasible, SpecError
from tppc.frontend.static_export import export_static
from tppc.planner.plan import Plan, Workload

__all__ = ["ComponentPlan", "PipelinePlan", "plan_pipeline"]

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""Attributes of a diffusers pipeline that hold its text encoders, in call order."""


@dataclass(frozen=True)
class ComponentPlan:
    """One component outside the transformer, placed on one device.

    Attributes:
        name: the pipeline attribute and method (``"text_encoder"``, ``"vae.decode"``).
        phase: ``"before"`` the denoising loop or ``"after"`` it.
        calls: calls per pipeline call (2 for a prompt and a negative prompt).
        device_index: position of its device in the cluster.
        cost: one call priced on that device.
        transfer_seconds: moving its output to the devices that read it.
    """

    name: str
    phase: str
    calls: int
    device_index: int
    cost: CallCost
    transfer_seconds: float

    @property
    def seconds(self) -> float:
        """Its share of the pipeline call: every call, then the transfer."""
        return self.calls * self.cost.seconds + self.transfer_seconds


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline call: the transformer's plan and the components around it.

    Attributes:
        transformer: the transformer's :class:`Plan` (its ``latency`` is the denoising loop).
        components: the text encoders (``phase="before"``) and the VAE decoder (``"after"``).
    """

    transformer: Plan
    components: tuple[ComponentPlan, ...]

    @property
    def latency(self) -> float:
        """Predicted seconds of one pipeline call."""
        return self.transformer.latency + sum(c.seconds for c in self.components)

    def summary(self) -> str:
        """One line per phase, then the transformer's plan."""
        lines = [f"pipeline call: {self.latency * 1e3:.2f} ms predicted"]
        for c in self.components:
            lines.append(
                f"  {c.phase:6} {c.name:16} x{c.calls} on device {c.device_index} "
                f"({c.cost.device_name}): {c.seconds * 1e3:.2f} ms "
                f"(weights {c.cost.weight_bytes / 2**20:.1f} MiB)")
        lines.append(f"  loop   transformer      {self.transformer.latency * 1e3:.2f} ms")
        return "\n".join([*lines, "", self.transformer.summary()])


def plan_pipeline(
    pipe: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    cluster: Cluster | str = "2xcpu",
    workload: Workload | None = None,
    prompt_tokens: int | Mapping[str, int] | None = None,
    encoder_calls: int = 1,
    decode: bool = True,
    decode_latent: torch.Tensor | None = None,
    transformer_plan: Plan | None = None,
    **plan_options: Any,
) -> PipelinePlan:
    """Plan ``pipe``'s transformer and place and price its text encoders and VAE decoder.

    Args:
        pipe: a diffusers pipeline (or anything with its attributes): ``transformer``, the
            ``text_encoder*`` modules, ``vae``, the ``tokenizer*``; modules may be on meta.
        args: the transformer's example inputs for one denoising call (as ``tppc.plan``).
        kwargs: its example keyword inputs.
        cluster: a :class:`Cluster` or a cluster string.
        workload: the denoising loop (default ``Workload(kind="diffusion")``).
        prompt_tokens: tokens each text encoder reads (one int, or per attribute name);
            default: its tokenizer's ``model_max_length``.
        encoder_calls: calls of each text encoder per pipeline call (2 with a negative
            prompt: classifier-free guidance encodes both).
        decode: price the VAE decoder (False for ``output_type="latent"``).
        decode_latent: the latent the VAE decodes (default: the transformer's first input,
            one sample, ``vae.config.latent_channels`` channels).
        transformer_plan: the transformer's plan when it is already made (``tppc.plan``
            with the same cluster); else it is planned here.
        **plan_options: other ``tppc.plan`` arguments (``num_stages``, ``time_limit``, the
            degrees ``cfg_parallel``, ``ulysses``, ``ring``, ``tensor_parallel``,
            ``intra_op`` (CPU clusters: workers of several devices' threads), ``patches``,
            ``memory_limit``...); degrees not given are chosen by price, and the summary
            names the chosen mix and the runner-up.

    Raises:
        SpecError: a bad argument, naming it and the fix.
        PlanInfeasible: a component fits on no device beside the stages.
        CaptureError, PlanError: from capturing or planning.
    """
    if encoder_calls < 1:
        raise SpecError(f"plan_pipeline: encoder_calls={encoder_calls}; give 1, or 2 when "
                        "the pipeline also encodes a negative prompt")
    encoders = [(name, module, _tokens(pipe, name, prompt_tokens)) for name in ENCODERS
                if isinstance(module := getattr(pipe, name, None), torch.nn.Module)]
    vae = getattr(pipe, "vae", None)
    decoder = None
    if decode and isinstance(vae, torch.nn.Module):
        decoder = decode_latent if decode_latent is not None else _latent(vae, args)
    parsed = Cluster.parse(cluster)
    transformer = transformer_plan or plan_transformer(
        pipe.transformer, args, kwargs, cluster=parsed,
        workload=workload or Workload(kind="diffusion"), **plan_options)
    memory = _Memory.beside(parsed, transformer)
    stage_devices = sorted({s.device_index for s in transformer.stages})
    placed = []
    for name, module, tokens in encoders:
        ids = torch.zeros(1, tokens, dtype=torch.long)
        placed.append(_place(name, "before", encoder_calls, export_static(module, (ids,)),
                             parsed, memory, stage_devices))
    if decoder is not None:
        graph = export_static(vae, (decoder,), method="decode")
        placed.append(_place("vae.decode", "after", 1, graph, parsed, memory,
                             [transformer.stages[-1].device_index]))
    return PipelinePlan(transformer=transformer, components=tuple(placed))


@dataclass
class _Memory:
    """Free bytes per memory pool: a device's own memory, except that the ``cpu`` devices of
    one node are cores of one machine and share its RAM (one pool: what any of them holds,
    all of them lose).

    Attributes:
        free: free bytes of each pool.
        pool_of: each device's pool.
    """

    free: list[int]
    pool_of: list[int]

    @classmethod
    def beside(cls, cluster: Cluster, plan: Plan) -> _Memory:
        """The pools less the transformer's stages: a stage's memory is held once per
        worker (an intra-op worker runs on several CPU devices' threads with one copy), in
        each pool its devices use."""
        pool_of = list(cluster.memory_pools())  # the planner's pools (cpu: one per node)
        free = [min(d.memory.capacity for d, p in zip(cluster.devices, pool_of) if p == pool)
                for pool in range(max(pool_of) + 1)]
        for stage in plan.stages:
            ids = stage.device_indices
            for first in range(0, len(ids), stage.intra_op):
                for pool in {pool_of[i] for i in ids[first:first + stage.intra_op]}:
                    free[pool] -= stage.memory_bytes
        return cls(free, pool_of)

    def of(self, device: int) -> int:
        """Free bytes on ``device`` (its pool's)."""
        return self.free[self.pool_of[device]]

    def take(self, device: int, nbytes: int) -> None:
        """``nbytes`` held on ``device``."""
        self.free[self.pool_of[device]] -= nbytes

    def per_device(self) -> list[float]:
        """Free GiB of every device, rounded (for messages)."""
        return [round(self.of(i) / 2**30, 2) for i in range(len(self.pool_of))]


def _tokens(pipe: Any, name: str, given: int | Mapping[str, int] | None) -> int:
    if isinstance(given, Mapping) and name in given:
        return int(given[name])
    if isinstance(given, int):
        return given
    tokenizer = getattr(pipe, name.replace("text_encoder", "tokenizer"), None)
    length = getattr(tokenizer, "model_max_length", None)
    if not isinstance(length, int) or not 1 < length <= 1 << 16:
        raise SpecError(
            f"plan_pipeline: no prompt length for {name} (its tokenizer's model_max_length is "
            f"{length!r}); pass prompt_tokens={{{name!r}: <tokens>}} (e.g. the pipeline's "
            "max_sequence_length)")
    return length


def _latent(vae: torch.nn.Module, args: tuple[Any, ...]) -> torch.Tensor:
    channels = getattr(getattr(vae, "config", None), "latent_channels", None)
    latent = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if latent is None or latent.dim() not in (4, 5) or channels is None:
        shape = None if latent is None else tuple(latent.shape)
        raise SpecError(
            f"plan_pipeline: cannot tell the VAE's latent from the transformer's input "
            f"(shape {shape}); pass decode_latent= (the unpacked latent the pipeline "
            "decodes), or decode=False")
    return latent[:1, :channels]


def _place(name: str, phase: str, calls: int, graph: torch.fx.GraphModule, cluster: Cluster,
           memory: _Memory, readers: list[int]) -> ComponentPlan:
    """The device where ``graph`` finishes soonest (calls + transfers) among those it fits
    on; its weights and working memory are taken off that device's free memory (its pool's:
    :class:`_Memory`)."""
    out_bytes = sum(t.numel() * t.element_size()
                    for node in graph.graph.find_nodes(op="output")
                    for arg in node.all_input_nodes for t in tensor_vals(arg.meta.get("val")))
    best: ComponentPlan | None = None
    priced: dict[Any, CallCost] = {}
    for index, device in enumerate(cluster.devices):
        if device not in priced:
            priced[device] = price_call(graph, device)
        cost = priced[device]
        if cost.weight_bytes + cost.activation_bytes > memory.of(index):
            continue
        transfer = sum(_hop_seconds(cluster, index, r, out_bytes) for r in readers)
        option = ComponentPlan(name, phase, calls, index, cost, transfer)
        if best is None or option.seconds < best.seconds:
            best = option
    if best is None:
        cost = next(iter(priced.values()))
        need = cost.weight_bytes + cost.activation_bytes
        raise PlanInfeasible(
            f"plan_pipeline: {name} needs {need / 2**30:.2f} GiB (weights "
            f"{cost.weight_bytes / 2**30:.2f} GiB) and no device has that left beside the "
            f"transformer's stages (free GiB per device: {memory.per_device()}; the cpu "
            "devices of a node share its RAM); use larger devices or more of them")
    memory.take(best.device_index, best.cost.weight_bytes + best.cost.activation_bytes)
    return best


def _hop_seconds(cluster: Cluster, src: int, dst: int, nbytes: int) -> float:
    """Store-and-forward along the chain: every link between ``src`` and ``dst``."""
    lo, hi = sorted((src, dst))
    return sum(link.latency + nbytes / link.bandwidth for link in cluster.links[lo:hi])
