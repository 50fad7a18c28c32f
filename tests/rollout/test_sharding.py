from __future__ import annotations

import json
import math
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.errors import ExitCode, MalformedRecordError
from rollout.errors import ShardingError
from rollout.sharding import (
    MIN_RELATIVE_WEIGHT,
    ShardPlan,
    apportion,
    shard_tasks,
    throughput_weights,
)

weights_strategy = st.lists(
    st.one_of(
        st.just(0.0),
        st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False),
        st.integers(min_value=1, max_value=10),
    ),
    min_size=1,
    max_size=9,
).filter(lambda ws: sum(ws) > 0)


def ids(n: int) -> list[str]:
    return [f"src/train/{i}" for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(weights=weights_strategy, total=st.integers(0, 400), seed=st.integers(0, 2**32))
def test_every_task_is_placed_once_and_every_share_is_within_one_of_exact(
    weights: list[float], total: int, seed: int
) -> None:
    tasks = ids(total)
    shards = shard_tasks(tasks, weights, seed=seed, iteration=3)
    assert len(shards) == len(weights)
    placed = [t for shard in shards for t in shard]
    assert sorted(placed) == sorted(tasks)
    weight_sum = sum(Fraction(w) for w in weights)
    for shard, w in zip(shards, weights, strict=True):
        exact = total * Fraction(w) / weight_sum
        assert abs(len(shard) - exact) < 1


@settings(max_examples=100, deadline=None)
@given(weights=weights_strategy, total=st.integers(0, 200), seed=st.integers(0, 10**6))
def test_same_inputs_give_the_same_shards_whatever_the_input_order(
    weights: list[float], total: int, seed: int
) -> None:
    tasks = ids(total)
    shuffled = tasks[:]
    random.Random(seed).shuffle(shuffled)
    first = shard_tasks(tasks, weights, seed=seed, iteration=5)
    assert shard_tasks(tasks, weights, seed=seed, iteration=5) == first
    assert shard_tasks(shuffled, weights, seed=seed, iteration=5) == first


def test_iteration_and_seed_change_the_permutation() -> None:
    tasks = ids(50)
    base = shard_tasks(tasks, [1, 1], seed=0, iteration=0)
    assert shard_tasks(tasks, [1, 1], seed=0, iteration=1) != base
    assert shard_tasks(tasks, [1, 1], seed=1, iteration=0) != base


def test_apportionment_gives_leftovers_to_the_largest_remainders() -> None:
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [3, 1]) == [5, 2]  # quotas 5.25, 1.75
    assert apportion(5, [0, 2]) == [0, 5]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1, -1], r"the weight of rank 1, -1, is negative or not finite: weights are shares"),
        ([0, 0], r"sum to zero: at least one node must get work"),
        ([1, math.nan], r"the weight of rank 1, nan, is negative or not finite"),
        ([math.inf], r"the weight of rank 0, inf, is negative or not finite"),
        ([], r"no weights: give one weight per node"),
        ([1, "2"], r"the weight of rank 1, '2', is not a number"),
    ],
)
def test_bad_weights_are_refused_naming_the_value_and_the_fix(
    weights: list[float], message: str
) -> None:
    with pytest.raises(ShardingError, match=message):
        shard_tasks(ids(4), weights, seed=0, iteration=0)


def test_repeated_task_ids_are_refused() -> None:
    with pytest.raises(ShardingError, match=r"1 task ids repeat \(first: \['a'\]\)"):
        shard_tasks(["a", "b", "a"], [1], seed=0, iteration=0)


PLAN = Path("run/iterations/000004/shard-train.json")


def test_shard_plan_round_trips_through_versioned_json() -> None:
    plan = ShardPlan.build(ids(11), [2.0, 1.0, 0.5], seed=9, iteration=4)
    data = plan.to_bytes()
    body = json.loads(data)
    assert body["schema"] == "coordinator/shard-plan" and body["version"] == 1
    assert list(body) == ["schema", "version", "iteration", "seed", "weights", "assignments",
                          "frozen"]
    assert body["weights"] == [2.0, 1.0, 0.5] and body["assignments"][1] == list(plan.tasks_for(1))
    assert ShardPlan.from_bytes(data, PLAN) == plan
    assert plan.as_mapping()[1] == plan.tasks_for(1)
    body["added_by_a_newer_writer"] = True  # unknown fields are ignored
    assert ShardPlan.from_bytes(json.dumps(body).encode(), PLAN) == plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, r"version 2 is not supported \(this build reads 1\)"),
        ({"schema": "other"}, r"schema is 'other', expected 'coordinator/shard-plan'"),
        ({"iteration": "4"}, r"field 'iteration' must be an integer, got '4'"),
        ({"iteration": -1}, r"iteration=-1 is below 0"),
        ({"weights": [1.0]}, r"1 weights but 3 assignments"),
        ({"weights": [1.0, -1.0, 1.0]}, r"the weight of rank 1, -1.0, is negative"),
        ({"assignments": [["a"], ["a"], []]}, r"assigns a task id twice"),
        ({"assignments": [["a"], [""], []]}, r"empty or non-string task id"),
        ({"assignments": "x"}, r"field 'assignments' must be a list, got 'x'"),
        ({"assignments": [["a"], [7], []]}, r"field 'assignments' must be a string, got 7"),
        ({"seed": None}, r"field 'seed' must be an integer, got None"),
    ],
)
def test_malformed_shard_plans_are_refused_with_the_file_named(
    change: dict, message: str
) -> None:
    data = json.loads(ShardPlan.build(ids(5), [1, 1, 1], seed=0, iteration=4).to_bytes())
    data.update(change)
    with pytest.raises(MalformedRecordError, match=f"^{re.escape(str(PLAN))}: .*{message}") as info:
        ShardPlan.from_bytes(json.dumps(data).encode(), PLAN)
    assert info.value.path == PLAN and info.value.exit_code is ExitCode.CORRUPT


def test_a_shard_plan_with_a_field_of_the_wrong_type_is_coordinators_malformed_record() -> None:
    data = json.loads(ShardPlan.build(ids(4), [1, 1], seed=0, iteration=4).to_bytes())
    data["weights"] = ["1", 1]
    with pytest.raises(MalformedRecordError) as info:
        ShardPlan.from_bytes(json.dumps(data).encode(), PLAN)
    assert type(info.value) is MalformedRecordError  # coordinator's one type, no look-alike
    assert info.value.path == PLAN
    assert str(info.value) == f"{PLAN}: field 'weights' must be a finite number"


def test_invalid_json_is_a_malformed_plan() -> None:
    with pytest.raises(MalformedRecordError, match=r"shard-train\.json: not valid JSON"):
        ShardPlan.from_bytes(b"{", PLAN)


def test_throughput_weights_are_equal_without_measurements() -> None:
    assert throughput_weights({}, 3) == [1.0, 1.0, 1.0]
    assert throughput_weights({0: math.nan, 1: 0.0}, 2) == [1.0, 1.0]


def test_throughput_weights_follow_measured_speed_and_fill_gaps_with_the_mean() -> None:
    weights = throughput_weights({0: 30.0, 1: 10.0}, 3)
    assert weights[0] == pytest.approx(3 * weights[1])
    assert weights[2] == pytest.approx(2 * weights[1])  # mean of 30 and 10
    assert sum(weights) == pytest.approx(3)


def test_a_very_slow_rank_keeps_a_nonzero_share() -> None:
    weights = throughput_weights({0: 1000.0, 1: 0.001}, 2)
    assert weights[1] == pytest.approx(MIN_RELATIVE_WEIGHT * weights[0])
    assert len(shard_tasks(ids(100), weights, seed=0, iteration=0)[1]) >= 4


def test_throughput_of_an_unknown_rank_is_refused() -> None:
    with pytest.raises(ShardingError, match=r"rank 5, outside ranks 0\.\.1"):
        throughput_weights({5: 1.0}, 2)
    with pytest.raises(ShardingError, match="num_ranks=0 is below 1"):
        throughput_weights({}, 0)


def test_a_plan_over_members_gives_the_others_nothing() -> None:
    plan = ShardPlan.build(ids(12), [2.0, 1.0, 1.0], seed=3, iteration=2, members=[0, 2])
    assert plan.tasks_for(1) == ()
    assert [len(plan.tasks_for(r)) for r in (0, 2)] == [8, 4]
    assert sorted(t for a in plan.assignments for t in a) == sorted(ids(12))


@given(
    total=st.integers(0, 60),
    weights=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6),
    data=st.data(),
)
def test_a_plan_without_lost_ranks_places_every_task_exactly_once(
        total: int, weights: list[float], data: st.DataObject) -> None:
    plan = ShardPlan.build(ids(total), weights, seed=1, iteration=7)
    ranks = list(range(len(weights)))
    lost = data.draw(st.lists(st.sampled_from(ranks[1:]), min_size=1, unique=True))
    members = [r for r in ranks if r not in lost]
    saved = {r: data.draw(st.lists(st.sampled_from(plan.tasks_for(r)), unique=True))
             if plan.tasks_for(r) else [] for r in lost}
    after = plan.without(saved, members)
    assert sorted(t for a in after.assignments for t in a) == sorted(ids(total))
    for r in lost:
        assert set(after.tasks_for(r)) == set(saved[r])  # what it saved, nothing more
    for r in members:
        assert after.tasks_for(r)[: len(plan.tasks_for(r))] == plan.tasks_for(r)  # own first
    assert after.frozen == tuple(sorted(lost))
    assert ShardPlan.from_bytes(after.to_bytes(), PLAN) == after
    # Deterministic: every node computes the same plan.
    assert plan.without(saved, members) == after


def test_a_plan_refuses_a_rank_that_saved_tasks_it_was_not_given() -> None:
    plan = ShardPlan.build(ids(6), [1, 1], seed=0, iteration=0)
    with pytest.raises(ShardingError, match="saved task ids it was not given"):
        plan.without({1: [plan.tasks_for(0)[0]]}, [0])
    with pytest.raises(ShardingError, match="exclude the ranks that left"):
        plan.without({1: []}, [0, 1])
