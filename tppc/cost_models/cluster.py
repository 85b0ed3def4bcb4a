"""A cluster: an ordered chain of devices, the links between neighbours, and its nodes.

Terms:
    chain: the devices in pipeline order; ``links[i]`` joins devices ``i`` and ``i + 1``.
    node: a run of consecutive devices in one machine (one NVLink domain); every device
        records its node (``Cluster.nodes``).
    inter-node link: what joins devices of different nodes (one NIC per device, e.g.
        InfiniBand); the chain link at a node boundary is this link.

Chain strings (one node) are groups joined by ``+``; a group is ``N x PRESET`` with an
optional ``@LINK`` that joins the devices inside the group::

    8xh100-sxm                  8 H100s joined by NVLink4 (the H100 default)
    2xh100-sxm+2xa100-80gb      a heterogeneous chain; H100→A100 uses the slower link
    4xa100-80gb@pcie4           4 A100s on PCIe Gen4
    4xtpu-v5p                   4 TPU v5p chips over ICI
    2xcpu                       2 stages on this CPU, priced by calibration (1 thread each,
                                measured while the other stage's load runs)

The link joining two groups is the slower of the two groups' links.

Topology strings (nodes) put each node's chain string in parentheses, optionally repeated
``K x``, node groups joined by ``+``, and name the inter-node link once, after the last
``)`` (required when there are two nodes or more)::

    4x(8xh20)@ib-ndr                 4 nodes of 8 H20s: NVLink 4 inside, NDR IB between
    (8xh100-sxm)+(8xa100-80gb)@ib-hdr   heterogeneous nodes over HDR InfiniBand
    2x(4xa100-80gb@pcie4)@ib-hdr     a node's own link goes inside its parentheses

Grammar (case-insensitive, spaces ignored)::

    cluster   := chain | nodes
    chain     := group ("+" group)*
    group     := [N "x"] DEVICE ["@" LINK]
    nodes     := node_group ("+" node_group)* ["@" LINK]
    node_group:= [K "x"] "(" chain ")"

Any two devices are joined by :meth:`Cluster.link`: inside a node, the slowest chain link
between them (the node's link, for a homogeneous node); across nodes, the inter-node link.

Example:
    >>> c = Cluster.parse("2xh100-sxm+2xa100-80gb")
    >>> [d.name for d in c.devices], [link.name for link in c.links]
    (['h100-sxm', 'h100-sxm', 'a100-80gb', 'a100-80gb'], ['nvlink4', 'nvlink3', 'nvlink3'])
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from tppc.cost_models.presets import DEFAULT_LINK, DEVICE_PRESETS, LINK_PRESETS
from tppc.cost_models.specs import DeviceSpec, LinkSpec
from tppc.errors import SpecError

__all__ = ["MAX_DEVICES", "Cluster", "cpu_device_count", "device_preset", "link_preset"]

_NODE_GROUP = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?\(([^()]*)\)\s*$")
_TOPOLOGY = re.compile(r"^(.*\))\s*(?:@\s*([a-z0-9._-]+))?\s*$", re.S)
_TOPOLOGY_FIX = ("write 'K x (CHAIN)' node groups joined by '+' and the inter-node link once "
                 "after the last ')', e.g. '4x(8xh20)@ib-ndr' or "
                 "'(8xh100-sxm)+(8xa100-80gb)@ib-hdr'")

MAX_DEVICES = 512
"""Most devices a cluster string may name (one pipeline stage per device; the planner's
placement search grows with devices × layers)."""

_GROUP = re.compile(r"^\s*(?:(\d+)\s*[x×*]\s*)?([a-z0-9][a-z0-9._-]*?)\s*(?:@\s*([a-z0-9._-]+))?\s*$")


def _valid_names() -> str:
    devices = ", ".join([*DEVICE_PRESETS, "cpu"])
    links = ", ".join([*LINK_PRESETS, "ici"])
    return f"valid devices: {devices}; valid links: {links}"


def device_preset(name: str, *, co_running: int = 1) -> DeviceSpec:
    """The spec of preset ``name``; ``cpu`` is calibrated on this machine (cached), with
    ``co_running`` CPU stages running at once (see :func:`.calibration.calibrate`).

    Raises:
        SpecError: unknown name; the message lists the valid presets.
    """
    key = name.strip().lower()
    if key == "cpu":
        from tppc.cost_models.calibration import calibrate

        return calibrate("cpu", co_running=co_running) if co_running > 1 else calibrate("cpu")
    if key not in DEVICE_PRESETS:
        raise SpecError(f"unknown device preset {name!r}; {_valid_names()}")
    return DEVICE_PRESETS[key]


def link_preset(name: str, device: str | None = None) -> LinkSpec:
    """The spec of link ``name``; ``ici`` picks the ICI of ``device``'s TPU generation.

    Raises:
        SpecError: unknown name; the message lists the valid links.
    """
    key = name.strip().lower()
    if key == "ici":
        key = DEFAULT_LINK.get(device or "", "ici-v5p")
        if not key.startswith("ici"):
            raise SpecError(f"link 'ici' needs a TPU device, got {device!r}; {_valid_names()}")
    if key not in LINK_PRESETS:
        raise SpecError(f"unknown link preset {name!r}; {_valid_names()}")
    return LINK_PRESETS[key]


def _chain_cpus(body: str) -> int:
    """CPU devices a chain string names (they share the machine's cores)."""
    groups = [_GROUP.match(part) for part in body.split("+")]
    return sum(int(g.group(1) or 1) for g in groups if g and g.group(2).strip() == "cpu")


def cpu_device_count(cluster: str | Cluster) -> int:
    """The ``cpu`` devices ``cluster`` names (they share this machine's cores), read off a
    cluster string without calibrating them (0 for a string that does not parse)."""
    if isinstance(cluster, Cluster):
        return sum(d.name == "cpu" for d in cluster.devices)
    lowered = cluster.lower()
    if "(" not in lowered:
        return _chain_cpus(lowered)
    whole = _TOPOLOGY.match(lowered)
    try:
        groups = [] if whole is None else [_NODE_GROUP.match(part) for part in
                                           _split_node_groups(whole.group(1), cluster)]
    except SpecError:
        return 0
    return sum(int(g.group(1) or 1) * _chain_cpus(g.group(2)) for g in groups if g)


def _check_total(text: str, total: int) -> None:
    if total > MAX_DEVICES:
        raise SpecError(
            f"cluster string {text!r} has more than MAX_DEVICES={MAX_DEVICES} devices; "
            "a token pipeline has one stage per device: plan for at most "
            f"{MAX_DEVICES} devices (e.g. one pipeline per node group)"
        )


def _parse_chain(body: str, text: str, cpus: int, before: int = 0,
                 ) -> tuple[list[DeviceSpec], list[LinkSpec]]:
    """The devices and neighbour links of chain string ``body`` (a part of ``text``)."""
    devices: list[DeviceSpec] = []
    links: list[LinkSpec] = []
    prev_link: LinkSpec | None = None
    for part in body.split("+"):
        match = _GROUP.match(part)
        if match is None:
            raise SpecError(
                f"cluster string {text!r}: cannot read group {part!r}; write "
                f"'N x DEVICE[@LINK]' groups joined by '+'; {_valid_names()}"
            )
        count = int(match.group(1) or 1)
        if count < 1:
            raise SpecError(f"cluster string {text!r}: group {part!r} has {count} devices; "
                            "give at least 1")
        _check_total(text, before + count + len(devices))
        family = match.group(2).strip()
        link_name = match.group(3) or DEFAULT_LINK.get(family)
        try:
            device = device_preset(family, co_running=cpus)  # CPU stages share it
            if link_name is None:
                raise SpecError(f"device {family!r} has no default link; add '@LINK'")
            link = link_preset(link_name, family)
        except SpecError as error:
            raise SpecError(f"cluster string {text!r}: {error}") from error
        if prev_link is not None:
            links.append(min(prev_link, link, key=lambda spec: spec.bandwidth))
        links.extend([link] * (count - 1))
        devices.extend([device] * count)
        prev_link = link
    return devices, links


def _split_node_groups(body: str, text: str) -> list[str]:
    """``body`` split at the ``+`` signs outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(body):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            what = "a ')' without its '('" if depth < 0 else "nested parentheses"
            raise SpecError(f"cluster string {text!r}: {what} at character {i}; "
                            f"{_TOPOLOGY_FIX}")
        if char == "+" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    if depth:
        raise SpecError(f"cluster string {text!r}: a '(' is never closed; {_TOPOLOGY_FIX}")
    return [*parts, body[start:]]


def _parse_topology(lowered: str, text: str) -> tuple[list[DeviceSpec], list[LinkSpec], list[int],
                                        LinkSpec | None]:
    """Devices, chain links, node of each device and inter-node link of a topology string."""
    whole = _TOPOLOGY.match(lowered)
    if whole is None:
        raise SpecError(f"cluster string {text!r}: a topology string puts every node in "
                        f"parentheses and ends with ')' or ')@LINK'; {_TOPOLOGY_FIX}")
    groups = []
    for part in _split_node_groups(whole.group(1), text):
        match = _NODE_GROUP.match(part)
        if match is None:
            raise SpecError(
                f"cluster string {text!r}: cannot read node group {part!r} (each node is a "
                "chain in parentheses; '@LINK' between node groups is not allowed, the "
                f"inter-node link comes once at the end); {_TOPOLOGY_FIX}")
        count = int(match.group(1) or 1)
        if count < 1 or not match.group(2).strip():
            raise SpecError(f"cluster string {text!r}: node group {part!r} has no devices; "
                            f"give K >= 1 nodes of at least one device; {_TOPOLOGY_FIX}")
        groups.append((count, match.group(2)))
    cpus = sum(count * _chain_cpus(body) for count, body in groups)
    num_nodes = sum(count for count, _ in groups)
    if num_nodes > 1 and whole.group(2) is None:
        raise SpecError(f"cluster string {text!r} has {num_nodes} nodes but no link between "
                        "them; add '@LINK' after the last ')', e.g. '@ib-ndr'; "
                        f"{_valid_names()}")
    try:
        inter = link_preset(whole.group(2)) if whole.group(2) else None
    except SpecError as error:
        raise SpecError(f"cluster string {text!r}: inter-node link: {error}") from error
    devices: list[DeviceSpec] = []
    links: list[LinkSpec] = []
    nodes: list[int] = []
    for count, body in groups:
        node_devices, node_links = _parse_chain(body, text, cpus, before=len(devices))
        for _ in range(count):
            _check_total(text, len(devices) + len(node_devices))
            if devices:
                links.append(inter)  # type: ignore[arg-type]  # set: nodes > 1
            nodes.extend([nodes[-1] + 1 if nodes else 0] * len(node_devices))
            devices.extend(node_devices)
            links.extend(node_links)
    return devices, links, nodes, inter


def _chain_text(devices: tuple[DeviceSpec, ...], links: tuple[LinkSpec, ...]) -> str:
    parts: list[str] = []
    i = 0
    while i < len(devices):
        j = i
        while (j + 1 < len(devices) and devices[j + 1] == devices[i]
               and (j == i or links[j] == links[i])):
            j += 1
        link = f"@{links[i].name}" if j > i else ""
        parts.append(f"{j - i + 1}x{devices[i].name}{link}")
        i = j + 1
    return "+".join(parts)


@dataclass(frozen=True)
class Cluster:
    """An ordered chain of devices in nodes; ``links[i]`` joins ``devices[i]`` and
    ``devices[i + 1]``.

    Attributes:
        devices: the devices in pipeline order (stage ``s`` runs on ``devices[s]``).
        links: one link per neighbouring pair (``len(devices) - 1`` of them); at a node
            boundary it is ``inter_node``.
        nodes: the node of each device, 0, 1, ... in chain order (default: all in node 0).
        inter_node: the link between devices of different nodes (required with 2+ nodes).
    """

    devices: tuple[DeviceSpec, ...]
    links: tuple[LinkSpec, ...]
    nodes: tuple[int, ...] = ()
    inter_node: LinkSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "nodes", tuple(self.nodes) or (0,) * len(self.devices))
        if not self.devices:
            raise SpecError("Cluster: no devices; give at least one, e.g. Cluster.parse('1xcpu')")
        if len(self.links) != len(self.devices) - 1:
            raise SpecError(
                f"Cluster: {len(self.devices)} devices need {len(self.devices) - 1} links, "
                f"got {len(self.links)}"
            )
        self._check_nodes()

    def _check_nodes(self) -> None:
        nodes = self.nodes
        if len(nodes) != len(self.devices) or nodes[0] != 0 or any(
                b - a not in (0, 1) for a, b in pairwise(nodes)):
            raise SpecError(f"Cluster: nodes {nodes} must give each of the {len(self.devices)} "
                            "devices its node, 0, 1, ... in chain order (a node is a run of "
                            "consecutive devices)")
        if nodes[-1] > 0 and self.inter_node is None:
            raise SpecError(f"Cluster: {nodes[-1] + 1} nodes but no inter_node link; give "
                            "one, e.g. inter_node=LINK_PRESETS['ib-ndr']")
        for i, (a, b) in enumerate(pairwise(nodes)):
            if a != b and self.links[i] != self.inter_node:
                inter = self.inter_node.name if self.inter_node else None
                raise SpecError(f"Cluster: links[{i}] joins nodes {a} and {b}, so it must be "
                                f"the inter-node link {inter!r}, got {self.links[i].name!r}")

    @property
    def num_devices(self) -> int:
        """Number of devices in the chain."""
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        """Number of nodes (1 for a chain string)."""
        return self.nodes[-1] + 1

    @property
    def device_names(self) -> tuple[str, ...]:
        """Preset name of each device, in chain order."""
        return tuple(d.name for d in self.devices)

    def memory_pools(self) -> tuple[int, ...]:
        """The memory pool of each device, numbered 0, 1, ... in chain order: a device's own
        memory, except that the ``cpu`` devices of one node are cores of one machine and
        share its RAM (one pool: what any of them holds, all of them lose)."""
        pools: dict[Any, int] = {}
        return tuple(pools.setdefault(("cpu", node) if device.name == "cpu" else index,
                                      len(pools))
                     for index, (device, node) in enumerate(zip(self.devices, self.nodes)))

    def node_devices(self, node: int) -> tuple[int, ...]:
        """Indices of the devices of ``node``."""
        if not 0 <= node < self.num_nodes:
            raise SpecError(f"Cluster: node {node} out of range; the cluster has "
                            f"{self.num_nodes} nodes (0..{self.num_nodes - 1})")
        return tuple(i for i, n in enumerate(self.nodes) if n == node)

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between devices ``a`` and ``b``: inside a node the slowest chain link
        between them, across nodes the inter-node link.

        Raises:
            SpecError: an index out of range, or ``a == b`` (a device has no link to itself).
        """
        for index in (a, b):
            if not isinstance(index, int) or not 0 <= index < self.num_devices:
                raise SpecError(f"Cluster: device index {index!r} out of range; the cluster "
                                f"has {self.num_devices} devices (0..{self.num_devices - 1})")
        if a == b:
            raise SpecError(f"Cluster: device {a} has no link to itself; give two different "
                            "devices")
        if self.nodes[a] != self.nodes[b]:
            return self.inter_node  # type: ignore[return-value]  # set: nodes > 1
        lo, hi = min(a, b), max(a, b)
        return min(self.links[lo:hi], key=lambda spec: spec.bandwidth)

    @classmethod
    def parse(cls, text: str | Cluster) -> Cluster:
        """Build a cluster from a chain string such as ``"2xh100-sxm+2xa100-80gb@pcie4"`` or
        a topology string such as ``"4x(8xh20)@ib-ndr"`` (grammar: the module docstring).

        A ``Cluster`` is returned unchanged, so APIs can accept either.

        Raises:
            SpecError: malformed group or node group, unknown device or link, a count < 1,
                or nodes without an inter-node link; the message names the bad part, says
                how to write it and lists the valid presets and links.
        """
        if isinstance(text, Cluster):
            return text
        if not isinstance(text, str) or not text.strip():
            raise SpecError(f"cluster string {text!r} is empty; write e.g. '4xh100-sxm'")
        lowered = text.lower()
        if "(" in lowered or ")" in lowered:
            devices, links, nodes, inter = _parse_topology(lowered, text)
            return cls(devices=tuple(devices), links=tuple(links), nodes=tuple(nodes),
                       inter_node=inter)
        devices, links = _parse_chain(lowered, text, _chain_cpus(lowered))
        return cls(devices=tuple(devices), links=tuple(links))

    def __str__(self) -> str:
        if self.inter_node is None:
            return _chain_text(self.devices, self.links)
        texts = []
        for node in range(self.num_nodes):
            members = self.node_devices(node)
            texts.append(_chain_text(self.devices[members[0]:members[-1] + 1],
                                     self.links[members[0]:members[-1]]))
        parts: list[str] = []
        i = 0
        while i < len(texts):
            j = i
            while j + 1 < len(texts) and texts[j + 1] == texts[i]:
                j += 1
            parts.append(f"{j - i + 1}x({texts[i]})" if j > i else f"({texts[i]})")
            i = j + 1
        return "+".join(parts) + f"@{self.inter_node.name}"
