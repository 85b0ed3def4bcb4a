"""One schedule (actions per stage) serves the simulation and both torch executors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tppc
from tppc import examples
from tppc.errors import PlanError
from tppc.program.schedule import Action, flow_shop, serial_order, simulate


def test_simulate_replays_a_given_stage_order_by_hand() -> None:
    # stage 0 runs chunk 0 [0, 1], chunk 1 [1, 3]; stage 1 is told to run chunk 1 first:
    # chunk 1 [3, 4], then chunk 0 [4, 7] (the flow shop would end at 5).
    chunks = ((0, 1), (1, 2))
    (first,) = flow_shop(chunks, 1)
    actions = (first, tuple(reversed(first)))
    sched = simulate(np.array([[1.0, 2.0], [3.0, 1.0]]), actions=actions)
    assert sched.start.tolist() == [[0.0, 1.0], [4.0, 3.0]]
    assert sched.makespan == 7.0
    assert simulate(np.array([[1.0, 2.0], [3.0, 1.0]])).makespan == 5.0


def test_actions_that_wait_on_each_other_are_refused() -> None:
    a, b = Action(0, 0, 0, 1), Action(0, 1, 1, 2)
    with pytest.raises(PlanError, match="deadlock"):
        simulate(np.ones((2, 2)), actions=((a,), (b, a)))


def test_local_order_runs_dependencies_first_and_drains_early() -> None:
    (row,) = flow_shop(((0, 1), (1, 2), (2, 3)), 1)
    order = [(s, a.chunk) for s, a in serial_order((row, row))]
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    order = [(s, a.chunk) for s, a in serial_order((row, row[::-1]))]
    assert order == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]


def test_threads_executor_runs_the_programs_actions_in_their_order() -> None:
    model, args, _ = examples.gpt(seq_len=32, n_layer=2)
    cp = tppc.compile(model, args, chunks=4, num_stages=2, executor="threads")
    program = cp.program(32)
    chunks = ((0, 8), (8, 16), (16, 24), (24, 32))
    assert program.chunks == chunks
    in_order = tuple(Action(0, i, a, b) for i, (a, b) in enumerate(chunks))
    assert program.actions == (in_order, in_order)  # the flow shop the plan simulated
    cp(*args)
    assert [c for s, c, *_ in cp.last_trace if s == 1] == [0, 1, 2, 3]
    # a program told to run stage 1 backwards is run backwards (wrong for a causal model,
    # but it shows the executors take their order from the program, not from the chunks)
    key = next(k for k, v in cp._programs.items() if v is program)
    cp._programs[key] = dataclasses.replace(program, actions=(in_order, in_order[::-1]))
    cp(*args)
    assert [c for s, c, *_ in cp.last_trace if s == 1] == [3, 2, 1, 0]
    assert [c for s, c, *_ in cp.last_trace if s == 0] == [0, 1, 2, 3]
