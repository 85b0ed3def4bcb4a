"""A cluster: an ordered chain of devices and the links between neighbours.

Cluster strings are groups joined by ``+``; a group is ``N x PRESET`` with an optional
``@LINK`` that joins the devices inside the group::

    8xh100-sxm                  8 H100s joined by NVLink4 (the H100 default)
    2xh100-sxm+2xa100-80gb      a heterogeneous chain; H100→A100 uses the slower link
    4xa100-80gb@pcie4           4 A100s on PCIe Gen4
    4xtpu-v5p                   4 TPU v5p chips over ICI
    2xcpu                       2 stages on this CPU, priced by calibration (1 thread each,
                                measured while the other stage's load runs)

The link joining two groups is the slower of the two groups' links.

Example:
    >>> c = Cluster.parse("2xh100-sxm+2xa100-80gb")
    >>> [d.name for d in c.devices], [link.name for link in c.links]
    (['h100-sxm', 'h100-sxm', 'a100-80gb', 'a100-80gb'], ['nvlink4', 'nvlink3', 'nvlink3'])
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tppc.cost_models.presets import DEFAULT_LINK, DEVICE_PRESETS, LINK_PRESETS
from tppc.cost_models.specs import DeviceSpec, LinkSpec
from tppc.errors import SpecError

__all__ = ["MAX_DEVICES", "Cluster", "device_preset", "link_preset"]

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


@dataclass(frozen=True)
class Cluster:
    """An ordered chain of devices; ``links[i]`` joins ``devices[i]`` and ``devices[i + 1]``.

    Attributes:
        devices: the devices in pipeline order (stage ``s`` runs on ``devices[s]``).
        links: one link per neighbouring pair (``len(devices) - 1`` of them).
    """

    devices: tuple[DeviceSpec, ...]
    links: tuple[LinkSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.devices:
            raise SpecError("Cluster: no devices; give at least one, e.g. Cluster.parse('1xcpu')")
        if len(self.links) != len(self.devices) - 1:
            raise SpecError(
                f"Cluster: {len(self.devices)} devices need {len(self.devices) - 1} links, "
                f"got {len(self.links)}"
            )

    @property
    def num_devices(self) -> int:
        """Number of devices in the chain."""
        return len(self.devices)

    @property
    def device_names(self) -> tuple[str, ...]:
        """Preset name of each device, in chain order."""
        return tuple(d.name for d in self.devices)

    @classmethod
    def parse(cls, text: str | Cluster) -> Cluster:
        """Build a cluster from a string such as ``"2xh100-sxm+2xa100-80gb@pcie4"``.

        A ``Cluster`` is returned unchanged, so APIs can accept either.

        Raises:
            SpecError: malformed group, unknown device or link, or a count < 1; the message
                names the bad part and lists the valid presets and links.
        """
        if isinstance(text, Cluster):
            return text
        if not isinstance(text, str) or not text.strip():
            raise SpecError(f"cluster string {text!r} is empty; write e.g. '4xh100-sxm'")
        devices: list[DeviceSpec] = []
        links: list[LinkSpec] = []
        prev_link: LinkSpec | None = None
        groups = [_GROUP.match(part) for part in text.lower().split("+")]
        cpus = sum(int(g.group(1) or 1) for g in groups if g and g.group(2).strip() == "cpu")
        for part in text.lower().split("+"):
            match = _GROUP.match(part)
            if match is None:
                raise SpecError(
                    f"cluster string {text!r}: cannot read group {part!r}; write "
                    f"'N x DEVICE[@LINK]' groups joined by '+'; {_valid_names()}"
                )
            count = int(match.group(1) or 1)
            if count < 1:
                raise SpecError(f"cluster string {text!r}: group {part!r} has {count} devices")
            if count + len(devices) > MAX_DEVICES:
                raise SpecError(
                    f"cluster string {text!r} has more than MAX_DEVICES={MAX_DEVICES} devices; "
                    "a token pipeline has one stage per device: plan for at most "
                    f"{MAX_DEVICES} devices (e.g. one pipeline per node group)"
                )
            device = device_preset(match.group(2), co_running=cpus)  # CPU stages share it
            family = match.group(2).strip()
            link_name = match.group(3) or DEFAULT_LINK.get(family)
            if link_name is None:
                raise SpecError(f"device {family!r} has no default link; add '@LINK'")
            link = link_preset(link_name, family)
            if prev_link is not None:
                links.append(min(prev_link, link, key=lambda spec: spec.bandwidth))
            links.extend([link] * (count - 1))
            devices.extend([device] * count)
            prev_link = link
        return cls(devices=tuple(devices), links=tuple(links))

    def __str__(self) -> str:
        parts: list[str] = []
        i = 0
        while i < len(self.devices):
            j = i
            while (j + 1 < len(self.devices) and self.devices[j + 1] == self.devices[i]
                   and (j == i or self.links[j] == self.links[i])):
                j += 1
            link = f"@{self.links[i].name}" if j > i else ""
            parts.append(f"{j - i + 1}x{self.devices[i].name}{link}")
            i = j + 1
        return "+".join(parts)
