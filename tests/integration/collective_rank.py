"""One rank of ``test_collective_ranks.py``: runs random action lists with collectives through
THE interpreter over the process-group transport (gloo) and saves its outputs.

Usage: ``python collective_rank.py OUT_DIR MODE SEED...`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; MODE is ``tensor`` or ``numpy`` (the distributed
artifact's values); seeds ``w<n>`` pick ``random_worker_lists``, ``c<n>`` ``random_lists``.
"""

from __future__ import annotations

import random
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.unit.collective_lists import compute, random_lists, random_worker_lists
from tppc.backends import wire
from tppc.backends.rank_transport import RankEnd, numpy_arrays, rank_deadline
from tppc.backends.torch_distributed import DistributedExecutor
from tppc.program.dry_run import check_actions
from tppc.program.interpreter import Interpreter


def main(out: Path, mode: str, seeds: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = DistributedExecutor(rank, world, timeout=60.0)
    numpy_mode = mode == "numpy"
    saved: dict[str, np.ndarray] = {}
    for seed in seeds:
        rng = random.Random(int(seed[1:]))
        if seed[0] == "w":
            lists, groups, stages = random_worker_lists(rng)
        else:
            (lists, groups), stages = random_lists(rng), ()
        dry = check_actions(lists, groups=groups, stages=stages)
        wrap = (lambda v: v) if numpy_mode else (lambda v: [torch.from_numpy(a) for a in v])

        def recv(act, wrap=wrap):
            got = wire.recv(act.peer, "cpu", lambda: timedelta(seconds=60))
            return wrap([t.numpy() for t in got])

        def send(act, values):
            wire.send([torch.from_numpy(np.asarray(v)) for v in values], act.peer, "cpu")
            return [], None

        def output(act, values, seed=seed):
            for j, v in enumerate(values):
                saved[f"{seed}/{rank}/{act.step}.{act.chunk}/{j}"] = np.asarray(v)

        transport = RankEnd(comm, dry, recv=recv, send=send, deadline=rank_deadline(comm, 60.0),
                            arrays=numpy_arrays() if numpy_mode else None)
        Interpreter(dry, rank, lambda act, got, wrap=wrap: wrap(compute(
            rank, act, [np.asarray(g) for g in got])), transport, output).run()
        dist.barrier()
    np.savez(out / f"rank{rank}.npz", **saved)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
