"""Placement and asynchrony settings: parsed, checked against the node count, and the
pure rules the loop asks (who rolls out in phase 10, the oldest version a batch takes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from coordinator.config.run_config import RunSection
from coordinator.errors import UsageError
from coordinator.machine.actions import kind, resolve_config
from rl.placement import Placement, RlRunSection, Role, parse_placement, placement_of
from rl.run_layouts import rule_of


def placement(rollout: str = "", train: str = "", k: int = 0, n: int = 3) -> Placement:
    return Placement.of(rollout_nodes=rollout, train_nodes=train, max_off_policy_steps=k,
                        num_nodes=n)


def test_ranks_and_ranges_parse_sorted() -> None:
    assert tuple(parse_placement("0", key="k", num_nodes=4)) == (0,)
    assert tuple(parse_placement("3, 0-1", key="k", num_nodes=4)) == (0, 1, 3)


@pytest.mark.parametrize(("text", "said"), [
    ("4", "node 4 is outside 0..3"), ("a", "'a' is not a node rank"),
    ("2-1", "runs backwards"), ("", "'' is not a node rank")])
def test_a_bad_rank_list_names_the_key_and_the_fix(text: str, said: str) -> None:
    with pytest.raises(UsageError, match=r"run\.train_nodes") as caught:
        parse_placement(text, key="run.train_nodes", num_nodes=4)
    assert said in str(caught.value)


def ahead(p: Placement, rank: int, iteration: int, iterations: int) -> bool:
    """Whether `rank` rolls out iteration+1's shard in phase 10 (rl/run_layouts.py)."""
    return rule_of(p).rolls_out_next(rolls_out=p.rolls_out(rank), iteration=iteration,
                                     iterations=iterations)


def test_the_default_is_colocated_and_synchronous() -> None:
    p = placement()
    assert p.colocated and not p.asynchronous and p.rollout == p.train == (0, 1, 2)
    assert p.rollout_weights([1, 2, 3]) == [1, 2, 3]
    assert not ahead(p, 1, 0, 8)


def test_naming_the_training_nodes_gives_the_rest_the_rollout() -> None:
    p = placement(train="0", k=1)
    assert (p.rollout, p.train, p.asynchronous, p.colocated) == ((1, 2), (0,), True, False)
    assert p.rollout_weights([1.0, 2.0, 3.0]) == [0.0, 2.0, 3.0]
    assert ahead(p, 1, 0, 8)
    assert not ahead(p, 0, 0, 8)  # a training node
    assert not ahead(p, 1, 7, 8)  # no iteration 8
    assert [p.oldest_version(i) for i in range(4)] == [0, 0, 1, 2]
    assert "nodes 1,2 roll out, nodes 0 train" in p.describe()


@pytest.mark.parametrize(("rollout", "train", "k", "said"), [
    ("", "", 1, "needs rollout and training on different GPUs"),
    ("0-1", "1-2", 0, "nodes 1 are in both"),
    ("0:4-7,1-2", "0", 0, "nodes 0 are in both"),
    ("0:2-5,1-2", "0:0-3", 0, "GPUs 2,3 of node 0 are in both"),
    ("0:4-7,0", "0:0-3", 0, "names node 0 twice"),
    ("0-1:4-7", "0:0-3", 0, "gives GPUs to a range of nodes"),
    ("1-2", "0:x", 0, "'x' is not a GPU index"),
    ("1-2", "0:3-1", 0, "runs backwards"),
    ("1", "0", 0, "nodes 2 neither roll out nor train"),
    ("0", "1-2", 0, "leaves out node 0"),
    ("0-2", "", 0, "leave no node to train"),
    ("", "0", 9, "outside 0..8"),
])
def test_a_placement_that_cannot_run_is_refused_naming_the_fix(
        rollout: str, train: str, k: int, said: str) -> None:
    with pytest.raises(UsageError) as caught:
        placement(rollout, train, k)
    assert said in str(caught.value)


def test_gpu_ranges_of_a_node_parse_and_merge() -> None:
    assert parse_placement("0:0-3,1-2", key="k", num_nodes=3) == {0: (0, 1, 2, 3), 1: None,
                                                                   2: None}
    assert parse_placement("0:6-7, 0:0", key="k", num_nodes=1) == {0: (0, 6, 7)}


def test_a_split_node_rolls_out_on_some_gpus_and_trains_on_the_others() -> None:
    """One node, 8 GPUs: 0-3 train, 4-7 roll out (RLinf's placement on one node)."""
    p = placement(rollout="0:4-7", train="0:0-3", k=1, n=1)
    assert (p.rollout, p.train, p.split_nodes) == ((0,), (0,), (0,))
    assert not p.colocated and p.asynchronous
    assert p.gpus(0, Role.ROLLOUT) == (4, 5, 6, 7) and p.gpus(0, Role.TRAIN) == (0, 1, 2, 3)
    assert ahead(p, 0, 0, 8)  # while it trains
    assert p.visible_devices(0, Role.TRAIN, None) == "0,1,2,3"
    # Indices count the GPUs the daemon sees: under CUDA_VISIBLE_DEVICES they pick from it.
    assert p.visible_devices(0, Role.ROLLOUT, "8,9,10,11,12,13,14,15") == "12,13,14,15"
    with pytest.raises(UsageError, match=r"node 0's GPUs 4-7 to rollout, but this node sees 4 "
                                         r"\(CUDA_VISIBLE_DEVICES='0,1,2,3'\)"):
        p.visible_devices(0, Role.ROLLOUT, "0,1,2,3")
    assert p.describe() == ("disaggregated: node 0 GPUs 4-7 roll out, node 0 GPUs 0-3 train; "
                            "asynchronous, at most 1 policy version(s) behind")


def test_whole_nodes_and_a_split_node_together() -> None:
    p = placement(rollout="0:4-7,1-2", train="0:0-3", n=3)
    assert (p.rollout, p.train, p.split_nodes, p.colocated) == ((0, 1, 2), (0,), (0,), False)
    assert p.visible_devices(1, Role.ROLLOUT, None) is None  # the whole node
    assert p.rollout_weights([1, 1, 1]) == [1, 1, 1]
    assert "nodes 1,2, node 0 GPUs 4-7 roll out" in p.describe()


def test_the_run_section_takes_a_single_node_as_a_number() -> None:
    config = resolve_config({"run": {"train_nodes": 0, "max_off_policy_steps": 1}})
    assert isinstance(config.run, RlRunSection)
    assert placement_of(config, 3).train == (0,)


def test_the_placement_keys_belong_to_the_kinds_that_declare_them() -> None:
    """The coordinator's own [run] knows nothing of roles: the rl and scripted kinds
    declare them (ActionKind.run_section), a kind that does not refuses them, and a
    config resolved for it places every role on every node."""
    from coordinator.config.run_config import RunConfig
    from coordinator.config.settings import UnknownSettingError

    for name in ("rl", "scripted"):
        assert kind(name).run_section is RlRunSection
    assert not {"train_nodes", "rollout_nodes", "max_off_policy_steps"} & {
        f.name for f in dataclasses.fields(RunSection)}
    with pytest.raises(UnknownSettingError, match=r"run\.train_nodes"):
        RunConfig.from_dict({"run": {"train_nodes": "0"}})
    assert placement_of(RunConfig.from_dict({}), 2).colocated


def test_a_master_refuses_an_asynchronous_run_whose_phase_10_deadline_is_below_rollouts(
        tmp_path: Path) -> None:
    from coordinator.machine.runplan import RunRequest, make_plan

    request = RunRequest(run_dir=tmp_path, rank=0, num_nodes=3, weights=None, config_file=None,
                         overrides={"run": {"train_nodes": "0", "max_off_policy_steps": 1},
                                    "coordination": {"phase_timeouts_s": {"train": 60.0,
                                                                          "rollout": 600.0}}})
    with pytest.raises(UsageError, match=r"phase_timeouts_s\.train=60 is below"):
        make_plan(request)
    assert not (tmp_path / "run.json").exists()  # refused before anything is written
    request = RunRequest(run_dir=tmp_path, rank=0, num_nodes=3, weights=(1.0, 0.0, 0.0),
                         config_file=None, overrides={"run": {"train_nodes": "0"}})
    with pytest.raises(UsageError, match="give the rollout nodes 1,2 no work"):
        make_plan(request)
