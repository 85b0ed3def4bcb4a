"""The cost table: what the cost model hands to the planner.

Terms:
    c: number of tokens in a chunk; p: number of tokens before it (the prefix);
    L: full sequence length. Times are seconds, sizes bytes.

This module is the contract between ``tppc.cost_models`` (which fills it from an annotated
graph and a cluster) and ``tppc.planner`` (which only reads it). Every ``time`` function is
numpy-vectorised: it takes arrays ``c`` and ``p`` of one shape and returns an array of that
shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MEMORY_FIELDS", "CostTable", "LayerCost", "LinkCost", "TimeFn"]

TimeFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``time(c, p) -> seconds``, vectorised over numpy arrays of equal shape."""


@dataclass(frozen=True)
class LayerCost:
    """Price of one layer on one device.

    Attributes:
        name: the layer's name (as in ``LayerInfo.name``).
        time: seconds to run the layer on a chunk of ``c`` tokens after ``p`` prefix tokens.
        weight_bytes: parameter and buffer bytes the layer holds.
        kv_bytes_per_token: K/V buffer bytes per token of sequence (full-length buffers).
        act_bytes_per_token: bytes per token of the activations that leave the layer.
        peak_bytes_per_token: bytes per chunk token of the values live at once inside the
            layer (the MLP intermediates of a block), while it runs on a chunk.
        positional_bytes_per_token: bytes per sequence token of the positional values (rope
            tables) the layer reads, held at the full length by its stage.
        workspace_bytes_per_key: bytes per (query row, key) of the causal attention kernel's
            mask, built for at most ``tppc.ir.ops.MASK_ELEMENTS`` rows × keys at once.
        parts: a block's two sub-layers (``<name>.attn``, ``<name>.mlp``: the block cut at
            its waist, see :mod:`tppc.passes.annotation.waist`), priced alike; empty when it
            has none.
    """

    name: str
    time: TimeFn
    weight_bytes: int
    kv_bytes_per_token: int
    act_bytes_per_token: int
    peak_bytes_per_token: int = 0
    positional_bytes_per_token: int = 0
    workspace_bytes_per_key: int = 0
    parts: tuple[LayerCost, ...] = ()


MEMORY_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LayerCost) if f.name not in ("name", "time", "parts"))
"""The memory fields of :class:`LayerCost` (what a layer holds and a chunk of it needs), which
:class:`tppc.cost_models.layer_pricer.LayerExpr` has too: ``layer_cost`` copies them."""


@dataclass(frozen=True)
class LinkCost:
    """Price of sending a chunk's boundary activations from device ``i`` to ``i + 1``.

    Attributes:
        latency: seconds per message.
        bandwidth: bytes per second in one direction.
    """

    latency: float
    bandwidth: float

    def time(self, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds to send ``nbytes`` (vectorised)."""
        return self.latency + np.asarray(nbytes, dtype=float) / self.bandwidth


@dataclass(frozen=True)
class CostTable:
    """Per-device, per-layer prices for one model on one cluster (chain of devices).

    Attributes:
        device_names: preset name of each device in chain order (``"h100-sxm"``...).
        capacities: usable memory of each device in bytes.
        layers: ``layers[d][l]`` is layer ``l`` priced on device ``d``'s spec.
        links: ``links[d]`` joins device ``d`` and ``d + 1`` (length ``len(devices) - 1``).
        seq_len: the full sequence length L the table was built for.
        causal: True when attention is causal (cost grows with the prefix), False for
            bidirectional (DiT) attention, whose cost does not depend on ``p``.
        unpriced_ops: op names the cost model has no rule for (priced as memory traffic
            only, so those layers may be under-priced); empty when every op was priced.
        queue_depth: chunks that may wait between two stages (the runtime's
            ``queue_depth``): a stage holds ``queue_depth + 1`` chunks of its input
            activations at once (see :mod:`tppc.planner.memory`).
        pools: the memory pool of each device (:meth:`Cluster.memory_pools`: the ``cpu``
            devices of one node share its RAM); the stages on one pool's devices are charged
            together against it (:func:`tppc.planner.memory.over_capacity`). Empty: each
            device its own.
    """

    device_names: tuple[str, ...]
    capacities: tuple[int, ...]
    layers: tuple[tuple[LayerCost, ...], ...]
    links: tuple[LinkCost, ...]
    seq_len: int
    causal: bool
    unpriced_ops: tuple[str, ...] = ()
    queue_depth: int = 2
    pools: tuple[int, ...] = ()

    @property
    def num_devices(self) -> int:
        """Number of devices in the chain."""
        return len(self.device_names)

    @property
    def num_layers(self) -> int:
        """Number of layers (prologue and epilogue included, when present)."""
        return len(self.layers[0]) if self.layers else 0

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The layers' names, in order."""
        return tuple(lc.name for lc in self.layers[0]) if self.layers else ()

    def times_at(self, c: float, p: float, devices: Sequence[int] | None = None
                 ) -> np.ndarray:
        """``[d, l]``: seconds of one chunk of ``c`` tokens after ``p`` on each layer of each
        of ``devices`` (default: all). Each distinct time function is evaluated once:
        identical blocks and identical devices share one (80 blocks × 8 devices of a 70B
        model on H100s are a handful of evaluations, not 656)."""
        seen: dict[int, float] = {}
        cc, pp = np.array([float(c)]), np.array([float(p)])

        def at(fn: TimeFn) -> float:
            if id(fn) not in seen:
                seen[id(fn)] = float(np.asarray(fn(cc, pp)).ravel()[0])
            return seen[id(fn)]

        rows = range(self.num_devices) if devices is None else devices
        return np.array([[at(lc.time) for lc in self.layers[d]] for d in rows])

    def with_layers(self, names: Sequence[str]) -> CostTable:
        """This table with some layers replaced by their two parts, so that its layers are
        ``names`` (a plan's layers: ``LayerCost.parts`` where it cuts a block at its waist).

        Raises:
            ValueError: ``names`` is not this table's layers with some of them split.
        """
        names = tuple(names)
        if names == self.layer_names:
            return self
        wanted = set(names)
        rows = tuple(tuple(part for lc in row for part in (
            lc.parts if lc.parts and lc.name not in wanted else (lc,))) for row in self.layers)
        table = dataclasses.replace(self, layers=rows)
        if table.layer_names != names:
            raise ValueError(f"layers {list(names[:4])}... are not the table's layers "
                             f"{list(self.layer_names[:4])}... with some cut into their parts")
        return table

    def scaled(self, factors: Sequence[float]) -> CostTable:
        """This table with every layer time of device ``d`` multiplied by ``factors[d]``
        (seconds measured per second predicted: :mod:`tppc.pipeline.rebalance`); links and
        memory unchanged. Identical time functions stay shared (``times_at`` evaluates each
        once)."""
        if len(factors) != self.num_devices:
            raise ValueError(f"{len(factors)} factors for {self.num_devices} devices")
        made: dict[tuple[int, float], TimeFn] = {}

        def scale(lc: LayerCost, f: float) -> LayerCost:
            key = (id(lc.time), f)
            if key not in made:
                made[key] = _Scaled(lc.time, f)
            return dataclasses.replace(lc, time=made[key],
                                       parts=tuple(scale(part, f) for part in lc.parts))

        return dataclasses.replace(self, layers=tuple(
            row if f == 1.0 else tuple(scale(lc, float(f)) for lc in row)
            for row, f in zip(self.layers, factors, strict=True)))

    def split_layer(self, index: int) -> CostTable:
        """This table with layer ``index`` replaced by its two parts (it must have them)."""
        row = self.layers[0]
        if not row[index].parts:
            raise ValueError(f"layer {row[index].name!r} has no parts (no waist)")
        return dataclasses.replace(self, layers=tuple(
            (*r[:index], *r[index].parts, *r[index + 1:]) for r in self.layers))


@dataclass(frozen=True)
class _Scaled:
    """``time(c, p) · factor`` (:meth:`CostTable.scaled`)."""

    time: TimeFn
    factor: float

    def __call__(self, c: np.ndarray, p: np.ndarray) -> np.ndarray:
        return np.asarray(self.time(c, p)) * self.factor
