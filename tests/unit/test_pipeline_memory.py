"""``plan_pipeline``'s memory beside the transformer's stages (:mod:`tppc.diffusers.pipeline_plan`).

The ``cpu`` devices of a cluster are cores of one machine and share its RAM: a component fits
only beside every stage and component on any of them, and an intra-op worker (one stage on
several CPU devices' threads) holds one copy. Devices with their own memory keep their own
(``tests/integration/test_pipeline_plan.py``). Each case is one byte on either side of the
bound, computed from the stages' memory and the components' prices.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tppc.cost_models.call_costs import price_call
from tppc.cost_models.cluster import Cluster
from tppc.diffusers import plan_pipeline
from tppc.errors import PlanInfeasible
from tppc.frontend.static_export import export_static
from tppc.planner.manual import manual_plan

M = 3 << 20  # bytes a stage holds
TOKENS = 8


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.proj = nn.Embedding(64, 128), nn.Linear(128, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class _Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 3, 3, padding=1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv(z)


@pytest.fixture(scope="module")
def parts() -> tuple[SimpleNamespace, torch.Tensor, int, int]:
    """The pipeline, the latent its VAE decodes, and the encoder's and decoder's bytes."""
    pipe, latent = SimpleNamespace(text_encoder=_Encoder(), vae=_Vae()), torch.randn(1, 4, 8, 8)
    cpu = Cluster.parse("2xcpu").devices[0]
    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    need = [price_call(export_static(m, a, method=f), cpu) for m, a, f in
            ((pipe.text_encoder, (ids,), "forward"), (pipe.vae, (latent,), "decode"))]
    return pipe, latent, *(c.weight_bytes + c.activation_bytes for c in need)


def _machine(ram: int) -> Cluster:
    """Two CPU devices of one machine with ``ram`` bytes."""
    parsed = Cluster.parse("2xcpu")
    memory = dataclasses.replace(parsed.devices[0].memory, capacity=ram)
    return dataclasses.replace(parsed, devices=tuple(dataclasses.replace(d, memory=memory)
                                                     for d in parsed.devices))


def _plan(parts, ram: int, stages, decode: bool):
    pipe, latent, _, _ = parts
    plan = manual_plan(2, 4, cuts=(0, 1, 2), boundaries=(0, 4))
    plan = dataclasses.replace(plan, stages=stages(plan.stages))
    return plan_pipeline(pipe, (), cluster=_machine(ram), prompt_tokens=TOKENS,
                         transformer_plan=plan, decode=decode, decode_latent=latent)


def _pipelined(stages):
    """Stage 0 on device 0, stage 1 on device 1, ``M`` bytes each."""
    return tuple(dataclasses.replace(s, memory_bytes=M) for s in stages)


def _intra_op(stages):
    """One stage of every layer: one worker on both devices' threads, ``M`` bytes."""
    first = stages[0]
    return (dataclasses.replace(first, layer_end=stages[-1].layer_end, memory_bytes=M,
                                device_indices=(0, 1), intra_op=2,
                                layer_names=first.layer_names + stages[-1].layer_names),)


def test_a_component_fits_beside_the_stages_of_every_cpu_device(parts) -> None:
    # each device alone has room (ram - M); the machine has none beside both stages
    _, _, encoder, _ = parts
    assert _plan(parts, 2 * M + encoder, _pipelined, decode=False).components
    with pytest.raises(PlanInfeasible, match=r"text_encoder needs.*share its RAM"):
        _plan(parts, 2 * M + encoder - 1, _pipelined, decode=False)


def test_an_intra_op_worker_holds_one_copy_and_components_share_the_ram(parts) -> None:
    _, _, encoder, decoder = parts
    pp = _plan(parts, M + encoder + decoder, _intra_op, decode=True)  # M once, not per device
    assert [c.name for c in pp.components] == ["text_encoder", "vae.decode"]
    # a byte less: the decoder fits on neither device beside the stage and the encoder
    with pytest.raises(PlanInfeasible, match="vae.decode needs"):
        _plan(parts, M + encoder + decoder - 1, _intra_op, decode=True)
