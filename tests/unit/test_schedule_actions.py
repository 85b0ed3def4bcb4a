"""The schedule as data: compute lists, their lowering to sends and receives, the dry run
that proves them deadlock-free and complete, and the simulation that replays them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tppc.errors import PlanError, ScheduleError
from tppc.program.schedule import Action, check_actions, flow_shop, lower, serial_order, simulate


def _names(rows) -> list[list[str]]:
    return [[str(a) for a in row] for row in rows]


def _drop(rows, stage: int, name: str):
    return tuple(tuple(a for a in row if not (s == stage and str(a) == name))
                 for s, row in enumerate(rows))


def test_lowering_sends_after_each_compute_and_receives_just_before() -> None:
    assert _names(lower(flow_shop(((0, 4), (4, 8)), 3))) == [
        ["C0.0", "S0.0>1", "C0.1", "S0.1>1"],
        ["R0.0<0", "C0.0", "S0.0>2", "R0.1<0", "C0.1", "S0.1>2"],
        ["R0.0<1", "C0.0", "R0.1<1", "C0.1"],
    ]


def test_lowering_of_several_steps_sends_each_chunk_back_to_stage_0() -> None:
    assert _names(lower(flow_shop(((0, 4), (4, 8)), 2, steps=2))) == [
        ["C0.0", "S0.0>1", "C0.1", "S0.1>1", "R0.0<1", "C1.0", "S1.0>1", "R0.1<1", "C1.1",
         "S1.1>1"],
        ["R0.0<0", "C0.0", "S0.0>0", "R0.1<0", "C0.1", "S0.1>0", "R1.0<0", "C1.0", "R1.1<0",
         "C1.1"],
    ]


def test_lowering_receives_in_the_senders_order() -> None:
    (row,) = flow_shop(((0, 1), (1, 2)), 1)
    # stage 1 computes the chunks the other way round: it must take chunk 0 off the wire
    # first (the dry run then refuses the order, see below)
    assert _names(lower((row, row[::-1])))[1] == ["R0.0<0", "R0.1<0", "C0.1", "C0.0"]


def _flow_shop_oracle(times, links, steps, back):
    """The flow-shop recurrence of the DESIGN.md planner section, written out by hand."""
    num_stages, m = times.shape
    end = np.zeros((num_stages, steps * m))
    start = np.zeros_like(end)
    for j in range(steps * m):
        i = j % m
        for s in range(num_stages):
            ready = end[s, j - 1] if j else 0.0
            if s:
                ready = max(ready, end[s - 1, j] + links[s - 1, i])
            elif j >= m and num_stages > 1:
                ready = max(ready, end[-1, j - m] + back[i])
            start[s, j], end[s, j] = ready, ready + times[s, i]
    return start, end


shapes = st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(1, 3))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_simulating_the_lowered_lists_is_the_flow_shop(shape, seed) -> None:
    num_stages, m, steps = shape
    rng = np.random.default_rng(seed)
    times, links, back = rng.random((num_stages, m)), rng.random((num_stages - 1, m)), \
        rng.random(m)
    start, end = _flow_shop_oracle(times, links, steps, back)
    chunks = tuple((3 * i, 3 * i + 3) for i in range(m))
    for actions in (flow_shop(chunks, num_stages, steps),
                    lower(flow_shop(chunks, num_stages, steps)), None):
        sched = simulate(times, links, steps=steps, back=back, actions=actions)
        np.testing.assert_allclose(sched.start, start)
        np.testing.assert_allclose(sched.end, end)


@settings(max_examples=60, deadline=None)
@given(shape=shapes)
def test_the_dry_run_passes_flow_shop_lists_of_any_shape(shape) -> None:
    num_stages, m, steps = shape
    actions = flow_shop(tuple((i, i + 1) for i in range(m)), num_stages, steps)
    dry = check_actions(actions)
    assert dry.actions == lower(actions)
    assert all(r >= 0 for row in dry.rounds for r in row)  # every action ran
    jobs = [(t, i) for t in range(steps) for i in range(m)]
    for s in range(num_stages):  # each stage computes every job once, in its list's order
        assert [a.job for st_, a in dry.computes() if st_ == s] == jobs
    sends = sum(a.kind == "send" for row in dry.actions for a in row)
    recvs = sum(a.kind == "recv" for row in dry.actions for a in row)
    back = (steps - 1) * m if num_stages > 1 else 0
    assert sends == recvs == (num_stages - 1) * steps * m + back


def test_simulate_follows_where_the_lists_put_their_sends() -> None:
    # stage 0 computes both chunks before sending either: stage 1 starts at 3, not at 1
    chunks = ((0, 1), (1, 2))
    actions = ((Action(0, 0, 0, 1), Action(0, 1, 1, 2), Action(0, 0, 0, 1, "send", 1),
                Action(0, 1, 1, 2, "send", 1)), lower(flow_shop(chunks, 2))[1])
    times = np.array([[1.0, 2.0], [3.0, 1.0]])
    sched = simulate(times, actions=actions)
    assert sched.start.tolist() == [[0.0, 1.0], [3.0, 6.0]]
    assert sched.makespan == 7.0
    assert simulate(times).makespan == 5.0  # the flow shop: stage 1 runs chunk 0 at [1, 4]


def test_serial_order_runs_dependencies_first_and_drains_early() -> None:
    (row,) = flow_shop(((0, 1), (1, 2), (2, 3)), 1)
    order = [(s, a.chunk) for s, a in serial_order((row, row))]
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def _fails(actions, **kw) -> str:
    with pytest.raises(ScheduleError) as info:
        check_actions(actions, **kw)
    assert isinstance(info.value, PlanError)
    return str(info.value)


def test_a_missing_receive_is_named_on_the_compute_that_needs_it() -> None:
    broken = _drop(lower(flow_shop(((0, 4), (4, 8)), 2)), 1, "R0.1<0")
    message = _fails(broken)
    assert message.startswith("stage 1 computes C0.1 before receiving it from stage 0")
    grid = message.splitlines()[1:]
    assert grid[0].split(" | ")[0].strip() == "stage"
    assert "[C0.1]" in grid[2] and "[" not in grid[1]  # stage 1's row, and only there


def test_two_stages_waiting_on_each_other_deadlock_with_both_marked() -> None:
    # stage 0 waits for chunk 0 back from stage 1 before sending it; stage 1 waits for it
    c = [Action(t, 0, 0, 4) for t in range(2)]
    s0 = (c[0], Action(0, 0, 0, 4, "recv", 1), Action(0, 0, 0, 4, "send", 1), c[1],
          Action(1, 0, 0, 4, "send", 1))
    s1 = (Action(0, 0, 0, 4, "recv", 0), c[0], Action(0, 0, 0, 4, "send", 0),
          Action(1, 0, 0, 4, "recv", 0), c[1])
    message = _fails((s0, s1))
    assert "deadlocks" in message.splitlines()[0]
    assert "stage 0 waits at R0.0<1" in message and "stage 1 waits at R0.0<0" in message
    rows = message.splitlines()[-2:]
    assert "[R0.0<1]" in rows[0] and "[R0.0<0]" in rows[1]


def test_a_chunk_out_of_order_is_refused() -> None:
    (row,) = flow_shop(((0, 1), (1, 2)), 1)
    message = _fails((row, row[::-1]))
    assert message.startswith("stage 1 computes C0.1 before chunk 0 of step 0")
    assert "[C0.1]" in message.splitlines()[-1]


def test_a_receive_out_of_the_senders_order_is_refused() -> None:
    s0, s1 = lower(flow_shop(((0, 1), (1, 2)), 2))
    swapped = (s1[2], s1[0], s1[1], s1[3])  # R0.1 before R0.0
    message = _fails((s0, swapped))
    assert "stage 1 receives R0.1<0 but the next message from stage 0 is job (0, 0)" in message
    assert "[R0.1<0]" in message.splitlines()[-1]


def test_a_send_nobody_receives_is_refused() -> None:
    s0, s1 = lower(flow_shop(((0, 1), (1, 2)), 2))
    extra = (*s0, Action(0, 1, 1, 2, "send", 1))
    message = _fails((extra, s1))
    assert message.startswith("stage 0 sends S0.1>1 that is never received")
    assert "[S0.1>1]" in message.splitlines()[-2]


def test_a_stage_that_skips_a_chunk_is_refused() -> None:
    (row,) = flow_shop(((0, 1), (1, 2), (2, 3)), 1)
    message = _fails((row, row[:2]))
    assert "stage 1 never" not in message  # stage 0's send of chunk 2 is unmatched first
    assert "[S0.2>1]" in message
    assert _fails((row[:2],) * 2 + (row,)).startswith("stage 2 computes C0.2 before "
                                                      "receiving it")


def test_blocking_sends_of_capacity_one_deadlock_the_feedback_edge() -> None:
    # 4 patches, 2 stages, 2 steps: the last stage may leave one patch unreceived on its way
    # back; stage 0 takes it only after its whole step, so both wait (torch executors buffer
    # the way back, which capacity=None models)
    actions = flow_shop(tuple((i, i + 1) for i in range(4)), 2, steps=2)
    check_actions(actions)
    message = _fails(actions, capacity=1)
    assert "deadlocks" in message.splitlines()[0]
    assert "[S0.1>0]" in message and "[S0.3>1]" in message


def test_a_long_schedule_prints_a_window_of_the_grid_around_the_failure() -> None:
    row = flow_shop(tuple((i, i + 1) for i in range(64)), 1)[0]
    bad = (*row[:40], row[41], row[40], *row[42:])
    message = _fails((row, bad))
    assert "[C0.41]" in message
    assert max(len(line) for line in message.splitlines()) < 400
    assert "…" in message.splitlines()[1]


def test_the_dry_run_is_cached_per_list() -> None:
    actions = flow_shop(tuple((i, i + 1) for i in range(8)), 4, steps=2)
    assert check_actions(actions) is check_actions(actions)
