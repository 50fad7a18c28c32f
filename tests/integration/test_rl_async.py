"""The asynchronous loop end to end on one split node: GPU 0 trains, GPU 1 rolls out,
and during each iteration's training the engine already rolls out the next one
on the policy it serves (run.max_off_policy_steps = 1).  The same loop on whole
nodes (node 0 trains, nodes 1-2 roll out), with nodes killed under each
on_failure policy: test_rl_netfs.py and test_rl_shrink.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.integration.usage import run_nodes

pytestmark = pytest.mark.slow
ITERATIONS = 4


def metrics(run: Path, iteration: int, name: str) -> dict:
    return json.loads((run / f"iterations/{iteration:06d}/metrics/{name}.json").read_text())


def arrival(run: Path, iteration: int, phase: int, rank: int) -> dict:
    return json.loads((run / f"iterations/{iteration:06d}/phase-{phase:02d}/arrive-{rank}.json")
                      .read_text())["payload"]


def test_one_node_trains_on_some_gpus_while_its_others_roll_out_ahead_and_it_learns(
        tmp_path: Path, warm_model: Path) -> None:
    """A split node (run.train_nodes = "0:0", run.rollout_nodes = "0:1"): its engine
    on one GPU, its trainer on another, and in phase 10 both at once: it trains
    iteration N while it rolls out N+1.  One node is a whole asynchronous run."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(warm_model, run / "model-init")  # the demo's model, built once per suite
    sets = ("run.train_nodes=0:0", "run.rollout_nodes=0:1", "run.max_off_policy_steps=1",
            "schedule.eval_interval=0")
    commands = [["coordinator", "run", "--master", "--num-nodes", "1", "--run-dir", str(run),
                 "--iterations", str(ITERATIONS), *(a for s in sets for a in ("--set", s))]]
    # One daemon, its engine and one trainer: 26 s on the 2-core machine.
    done = run_nodes(commands, cwd=tmp_path, timeout_s=400)
    log = done.logs[0]
    assert done.codes == {0: 0}, log[-3000:]
    assert "placement: disaggregated: node 0 GPUs 1 roll out, node 0 GPUs 0 train" in log
    assert "engine is to serve" in log and "on CUDA_VISIBLE_DEVICES=1" in log, log[-3000:]
    assert re.search(r"resident trainer group \S+ started .*on CUDA_VISIBLE_DEVICES=0\)", log)
    rewards = []
    for it in range(ITERATIONS):
        rollout, train = metrics(run, it, "rollout"), metrics(run, it, "train")
        assert rollout["num_failed"] == 0 and rollout["num_samples"] == 128 * 8
        assert train["samples"] == rollout["num_train_samples"] > 0
        # Iteration 0 rolls out on the initial policy; every later batch was rolled
        # out during the previous iteration's training, one version behind.
        assert rollout["policy_versions"] == {str(max(0, it - 1)): 128 * 8}, rollout
        assert rollout["staleness_max"] == min(it, 1) and rollout["stale_groups_dropped"] == 0
        # The loss is corrected by truncated importance sampling, capped at 2.
        assert 0 < train["tis_weight_mean"] <= 2.0 and train["world_size"] == 1
        rewards.append(rollout["reward_mean"])
        trained = arrival(run, it, 10, 0)
        assert trained["trainer"] in ("started", "kept") and trained["seconds"] > 0
        ahead = trained.get("next_rollout")
        if it < ITERATIONS - 1:  # the same phase rolled out the next iteration
            assert ahead["iteration"] == it + 1 and ahead["policy_version"] == it, ahead
            assert ahead["samples"] > 0 and ahead["stale_groups_dropped"] == 0, ahead
        else:
            assert ahead is None  # the run has no next iteration
    # Measured 0.107 -> 0.119 -> 0.132 -> 0.183; seeded sampling and training repeat.
    assert rewards[-1] > rewards[0] + 0.04, rewards
    # The engine stayed up through training and took each new policy at phase 12
    # between requests: paused, reloaded in place, resumed.
    served = [arrival(run, it, 12, 0) for it in range(ITERATIONS)]
    assert [s["engine"] for s in served] == ["updated in place"] * ITERATIONS, served
    assert len({s["engine_pid"] for s in served}) == 1, served
    # Phase 1 of every iteration checked that the engine serves phase 0's choice,
    # the newest policy (issue 32, point 6), rolled out ahead or not.
    from rl.contracts import policy_version

    chosen = [arrival(run, it, 1, 0)["serving"] for it in range(ITERATIONS)]
    assert [policy_version(name) for name in chosen] == list(range(ITERATIONS)), chosen
    assert f"{ITERATIONS * 1024} samples trained, 0 failed, 0 recoveries" in log, log[-2000:]
