"""Translation validation's localiser matches each piece of an op that export decomposed.

torch.export turns ``h.chunk(2)`` into a ``split`` and one ``getitem`` per piece, all with
the same origin (``meta["from_node"]``'s root), when it re-traces a graph with an in-place
write (HunyuanVideo's ``mask[:, :, :, 0] = True``). The localiser once kept one captured node per
origin (the last piece), so every emitted piece was compared with the last one and reported
as the first diverging value (HunyuanVideo's ``norm_out`` gate, far from the real fault).
"""

from __future__ import annotations

import operator
from types import SimpleNamespace

import torch
from torch import fx, nn

import tppc
from tppc.validation import localize
from tppc.validation.replay import origin


class _Gates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mod = nn.Linear(4, 4), nn.Linear(1, 12)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(t.float()[:, None]).chunk(3, dim=-1)
        gate = gate.clone()
        gate[:, 0] = 1.0  # an in-place write: export re-traces the graph and decomposes chunk
        return x + gate[:, None] * self.lin(x * (1 + scale[:, None]) + shift[:, None])


def test_each_piece_of_a_chunk_matches_its_own_captured_node() -> None:
    gm, _ = tppc.capture(_Gates().eval(), (torch.randn(1, 8, 4), torch.tensor([3])))
    pieces = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert len(pieces) == 3 and len({origin(n) for n in pieces}) == 1  # one origin for all
    origins = localize._origins(SimpleNamespace(annotated=gm))
    copies = fx.Graph()
    env = {n: copies.placeholder(f"in_{n.name}") for n in gm.graph.nodes if n.op != "output"}
    for piece in reversed(pieces):  # copies renamed (getitem_2 -> getitem ...): by index
        copy = copies.node_copy(piece, lambda a: env[a])
        copy.name = f"renamed_{piece.name}"
        assert localize._match(origins, copy) is piece
