"""Collectives in the action language: the dry run matches them across their group and
refuses what deadlocks, and every in-process transport runs them like an independent
reference (``tests/unit/collective_lists.py``); the process groups' run is in
``tests/integration/test_collective_ranks.py``."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.collective_lists import compute, random_lists, random_worker_lists, reference
from tppc.backends.torch_local import TORCH_OPS
from tppc.errors import ScheduleError
from tppc.program.actions import Action, flow_shop, lower
from tppc.program.collectives import NUMPY
from tppc.program.dry_run import check_actions
from tppc.program.interpreter import Interpreter, run_in_order
from tppc.program.schedule import simulate
from tppc.program.threads import ThreadWorld


def _ar(chunk: int, group: str = "g", kind: str = "all_reduce", dims: tuple = ()) -> Action:
    return Action(0, chunk, 4 * chunk, 4 * chunk + 4, kind, group=group, dims=dims)


def _serial(dry, torch_values: bool) -> dict:
    out = {}
    wrap = (lambda v: [torch.from_numpy(a) for a in v]) if torch_values else (lambda v: v)
    run_in_order(dry, lambda s, act, got: wrap(compute(s, act, [np.asarray(g) for g in got])),
                 output=lambda s, act, values: out.__setitem__((s, act.job), values),
                 ops=TORCH_OPS if torch_values else NUMPY)
    return out


def _threads(dry, torch_values: bool) -> dict:
    out, lock = {}, threading.Lock()
    world = ThreadWorld(dry, 2, TORCH_OPS if torch_values else NUMPY)
    wrap = (lambda v: [torch.from_numpy(a) for a in v]) if torch_values else (lambda v: v)

    def output(s: int, act: Action, values: object) -> None:
        with lock:
            out[(s, act.job)] = values

    def work(s: int) -> None:
        world.work(Interpreter(
            dry, s, lambda act, got: wrap(compute(s, act, [np.asarray(g) for g in got])),
            world.end(s), lambda act, values: output(s, act, values)))

    for t in world.threads(work, "test-collective"):
        t.join(timeout=60)
        assert not t.is_alive(), "a worker hung on lists the dry run accepted"
    if world.errors:
        raise world.errors[0]
    return out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, values in want.items():
        assert len(got[key]) == len(values)
        for a, b in zip(got[key], values):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=str(key))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_lists_with_collectives_run_like_the_reference_or_are_refused(seed: int) -> None:
    lists, groups = random_lists(random.Random(seed))
    want = reference(lists, groups)
    if want is None:  # the reference deadlocks: the dry run refuses the lists
        with pytest.raises(ScheduleError, match="deadlocks"):
            check_actions(lists, groups=groups)
        return
    dry = check_actions(lists, groups=groups)
    for torch_values in (True, False):  # torch tensors (local, threads); numpy (ORT)
        _same(_serial(dry, torch_values), want)
        _same(_threads(dry, torch_values), want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_stages_of_several_workers_run_their_group_collectives_like_the_reference(
        seed: int) -> None:
    lists, groups, stages = random_worker_lists(random.Random(seed))
    want = reference(lists, groups, stages)
    assert want is not None  # a stage's collectives come after its own receives: no deadlock
    dry = check_actions(lists, groups=groups, stages=stages)
    for torch_values in (True, False):
        _same(_serial(dry, torch_values), want)
        _same(_threads(dry, torch_values), want)


def test_lowering_puts_a_collective_between_its_compute_and_the_send() -> None:
    lists = [list(row) for row in flow_shop(((0, 4), (4, 8)), 2)]
    lists[0].insert(1, _ar(0, "g0"))
    groups = (("g0", (0,)),)
    assert [str(a) for a in lower(tuple(map(tuple, lists)))[0]] == \
        ["C0.0", "AR0.0@g0", "S0.0>1", "C0.1", "S0.1>1"]
    check_actions(tuple(map(tuple, lists)), groups=groups)


def test_members_in_another_order_are_refused_naming_both() -> None:
    rows = [list(r) for r in lower(flow_shop(((0, 4), (4, 8)), 2))]
    rows[0] += [_ar(0), _ar(1)]
    rows[1] += [_ar(1), _ar(0)]
    with pytest.raises(ScheduleError, match=r"collective 0 of group 'g' is AR0.(0|1)@g on stage"
                                            r" \d but AR0.(0|1)@g on stage \d") as info:
        check_actions(tuple(map(tuple, rows)), groups=(("g", (0, 1)),))
    assert "[AR0.0@g]" in str(info.value) and "[AR0.1@g]" in str(info.value)


def test_a_collective_that_waits_for_its_own_send_deadlocks() -> None:
    rows = [list(r) for r in lower(flow_shop(((0, 4),), 2))]
    rows[0].insert(1, _ar(0))  # stage 0 waits in it for stage 1, which waits for the send
    rows[1].append(_ar(0))
    with pytest.raises(ScheduleError, match="deadlocks.*group 'g': stages \\[1\\] have not "
                                            "reached it"):
        check_actions(tuple(map(tuple, rows)), groups=(("g", (0, 1)),))


def test_a_collective_over_an_unnamed_group_or_before_its_compute_is_refused() -> None:
    rows = [list(r) for r in lower(flow_shop(((0, 4),), 2))]
    with pytest.raises(ScheduleError, match="group 'h', which is not named"):
        check_actions((tuple(rows[0] + [_ar(0, "h")]), tuple(rows[1])), groups=(("g", (0,)),))
    with pytest.raises(ScheduleError, match="before computing its job"):
        check_actions(((_ar(0), *rows[0]), tuple(rows[1])), groups=(("g", (0,)),))


def test_a_part_that_does_not_divide_names_the_fix() -> None:
    rows = tuple((Action(0, 0, 0, 4), _ar(0, kind="all_to_all", dims=(0, 1)))
                 for _ in range(3))  # three workers of one stage
    dry = check_actions(rows, groups=(("g", (0, 1, 2)),), stages=(0, 0, 0))
    with pytest.raises(ScheduleError, match=r"cuts axis 0 of size 4 .* into 3 equal parts.*"
                                            r"fix: a size divisible"):
        run_in_order(dry, lambda s, act, got: [np.zeros((4, 2))], output=lambda *a: None,
                     ops=NUMPY)


def test_simulate_ends_a_collective_when_its_last_member_reaches_it() -> None:
    rows = ((Action(0, 0, 0, 1), _ar(0, "g")), (Action(0, 0, 0, 1), _ar(0, "g")))
    sched = simulate(np.array([[1.0], [3.0]]), np.zeros((1, 1)), actions=rows,
                     groups=(("g", (0, 1)),), stages=(0, 0))
    assert sched.makespan == 3.0  # stage 0 waits for stage 1 in the all-reduce


def test_the_grid_shows_collectives() -> None:
    rows = tuple((*r, _ar(0)) for r in lower(flow_shop(((0, 4),), 2)))
    grid = check_actions(rows, groups=(("g", (0, 1)),)).grid()
    assert "AR0.0@g" in grid


def test_a_send_past_the_next_stage_is_refused() -> None:
    c, s2, r0, r1 = (Action(0, 0, 0, 4), Action(0, 0, 0, 4, "send", 2),
                     Action(0, 0, 0, 4, "recv", 0), Action(0, 0, 0, 4, "recv", 1))
    with pytest.raises(ScheduleError, match="a stage sends to the next stage only"):
        check_actions(((c, s2), (r0, c, s2), (r1, c)), stages=(0, 1, 2))
