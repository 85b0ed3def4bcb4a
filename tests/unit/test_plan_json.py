"""A plan's JSON: its schema, its unit (tokens, patch rows, blocks) and older schemas read."""

from __future__ import annotations

import dataclasses
import json

import pytest
from planner_helpers import table

from tppc.errors import PlanError
from tppc.planner import PLAN_SCHEMA, Plan, Workload, plan_for, plan_from_costs


def _two_layers() -> Plan:
    return plan_for(table(num_layers=2, speeds=(1.0, 1.0)), (0, 1, 2), (0, 512, 1024))


def test_plan_json_round_trip() -> None:
    t = table(num_layers=4, speeds=(1.0, 2.0), seq_len=1024)
    plan = plan_from_costs(
        t, granularity=128, workload=Workload(kind="diffusion", steps=3, warmup_steps=1)
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert "stage" in plan.summary()


def test_plan_json_with_wrong_schema_is_rejected() -> None:
    plan = _two_layers()
    bad = plan.to_json().replace(PLAN_SCHEMA, "tppc.plan/0")
    assert bad != plan.to_json()
    with pytest.raises(PlanError, match="schema"):
        Plan.from_json(bad)


def test_plan_json_says_its_unit_and_round_trips_it() -> None:
    plan = dataclasses.replace(
        _two_layers(),
        seq_len=64, granularity=8, boundaries=(0, 32, 64), tokens_per_unit=16)
    data = json.loads(plan.to_json())
    assert (data["schema"], data["tokens_per_unit"]) == ("tppc.plan/6", 16)
    assert Plan.from_json(plan.to_json()) == plan
    assert (plan.unit, plan.seq_tokens) == ("patch rows of 16 tokens", 1024)
    assert "chunks (patch rows of 16 tokens): 32 32" in plan.summary()


def test_a_block_plan_says_its_unit_is_a_block_and_round_trips_it() -> None:
    # a block capture's unit is a block of k tokens of its scan; the plan said "rows of k"
    plan = dataclasses.replace(
        _two_layers(),
        seq_len=256, granularity=1, boundaries=(0, 128, 256), tokens_per_unit=4, blocks=True)
    assert (plan.unit, plan.seq_tokens) == ("blocks of 4 tokens", 1024)
    assert "seq_len=256 blocks of 4 tokens (1024 tokens)" in plan.summary()
    assert "chunks (blocks of 4 tokens): 128 128" in plan.summary()
    assert json.loads(plan.to_json())["blocks"] is True
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="blocks=True with tokens_per_unit=1"):
        dataclasses.replace(plan, tokens_per_unit=1)


def test_a_schema_5_plan_of_several_tokens_a_unit_reads_as_patch_rows() -> None:
    plan = dataclasses.replace(
        _two_layers(),
        seq_len=64, granularity=8, boundaries=(0, 32, 64), tokens_per_unit=16)
    data = json.loads(plan.to_json())
    del data["blocks"]
    old = Plan.from_json(json.dumps({**data, "schema": "tppc.plan/5"}))
    assert old == plan and old.unit == "patch rows of 16 tokens"


def test_a_schema_1_plan_json_reads_as_tokens() -> None:
    plan = _two_layers()
    data = json.loads(plan.to_json())
    del data["tokens_per_unit"]
    old = Plan.from_json(json.dumps({**data, "schema": "tppc.plan/1"}))
    assert old == plan and (old.tokens_per_unit, old.unit) == (1, "tokens")
