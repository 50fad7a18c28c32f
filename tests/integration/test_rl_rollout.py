"""Three daemons run real rollouts (hf engine, tiny model) and the master merges them.

The tasks are a verl user's: a generated GSM8K-style parquet named by
data.train_files and data.val_files (chat prompts through the model's chat
template), scored by a reward file each node names itself (reward.path,
examples/rewards/gsm8k.py, in each node's worker process)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.support.cluster import LocalCluster

pytestmark = pytest.mark.slow

CONFIG = """
[run]
actions = "rl"
iterations = 1

[schedule]
rl_phase = "rollout"
eval_interval = 1
eval_before_train = true

[model]
path = "{model}"

[data]
train_files = "{train}"
val_files = ["{test}"]

[reward]
path = "{reward}"

[rollout]
group_size = 4
tasks_per_iteration = 21
eval_tasks = 9
eval_group_size = 2
eval_temperature = 1.0  # two samples of a chat prompt: greedy takes one (n=1)
checkpoint_every_groups = 4
max_tokens = 6

[coordination]
heartbeat_interval_s = 0.5
lease_s = 10.0
join_timeout_s = 120.0
"""


def test_three_ranks_roll_out_and_the_batch_holds_every_assigned_task_times_the_group(
    tmp_path: Path, tiny_model: Path
) -> None:
    from examples.gsm8k_style import SHORT_INSTRUCTION, write
    from rollout.sharding import ShardPlan
    from rollout.train_batch import load_train_batch

    data = write(tmp_path / "gsm8k", train=32, test=12, seed=0, instruction=SHORT_INSTRUCTION)
    reward = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "gsm8k.py"
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(model=tiny_model, train=data["train"], test=data["test"],
                                    reward=reward))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config,
                     master_args=("--rank-weights", "2,1,1"))
    try:
        c.start(0)
        for rank in (1, 2):  # reward.path is node-local: every node names its own
            c.start(rank, [*c.command(rank), "--set", f"reward.path={reward}"])
        codes = c.wait_all(timeout=300)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    it = c.run_dir / "iterations" / "000000"
    plan_path = it / "shard-train.json"
    plan = ShardPlan.from_bytes(plan_path.read_bytes(), plan_path)
    shares = [len(plan.tasks_for(r)) for r in range(3)]
    assert sum(shares) == 21 and shares == [11, 5, 5]  # 2:1:1 of 21, largest remainder
    batch = load_train_batch(it / "batch.pt")
    counts = Counter(batch.task_ids)
    assigned = [t for r in range(3) for t in plan.tasks_for(r)]
    assert sorted(counts) == sorted(assigned)
    for task_id in assigned:
        assert counts[task_id] == 4, task_id
    metrics = json.loads((it / "metrics" / "rollout.json").read_text())
    assert metrics["num_samples"] == 84 and metrics["num_failed"] == 0
    assert set(metrics["samples_per_second"]) == {"0", "1", "2"}
    # Every answer went through the file's compute_score (a call each, none timed out),
    # and the numbers of its dict beside the score are the iteration's metrics.
    assert (metrics["reward_calls"], metrics["reward_timeouts"]) == (84, 0)
    assert set(metrics["reward_extra"]) == {"acc", "formatted"}
    assert metrics["reward_extra"]["acc"] == pytest.approx(metrics["reward_mean"])
    evaluation = json.loads((it / "metrics" / "eval.json").read_text())
    assert evaluation["num_samples"] == 18 and 0.0 <= evaluation["accuracy"] <= 1.0
    assert evaluation["reward_calls"] == 18 and set(evaluation["reward_extra"]) == {
        "acc", "formatted"}
    # Each node checked its own reward file at phase 0 and reported the same one.
    from coordinator.records import layout

    for rank in range(3):
        arrival = json.loads((c.run_dir / layout.arrival(0, 0, rank)).read_text())
        assert arrival["payload"]["reward"].startswith("reward.path's compute_score in a "
                                                       "file of SHA-256 "), arrival
    # Every engine was stopped at phase 7: no server process is left.
    import psutil

    run_id = json.loads((c.run_dir / "run.json").read_text())["run_id"]
    servers = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    servers = [s for s in servers if "rollout.hf.server" in s]
    assert not [s for s in servers if run_id in s], servers
    # The engines served the node-local, verified copies of the model.
    engine_log = (c.run_dir / "ranks" / "1" / "logs").iterdir()
    assert any(run_id in p.read_text(errors="replace") for p in engine_log)


def test_rank_weights_auto_follow_the_previous_iterations_throughput(tmp_path: Path) -> None:
    from coordinator.machine.actions import StepContext, resolve_config
    from coordinator.machine.runtime import Runtime
    from coordinator.records.phases import Phase
    from rl import layout
    from rl.actions import RlActions
    from rl.plan import rank_weights

    config = resolve_config({"run": {"actions": "rl"}})
    actions = RlActions(config, rank=0, num_nodes=3, run_dir=tmp_path)

    def ctx(iteration: int) -> StepContext:
        return StepContext(rank=0, num_nodes=3, iteration=iteration, phase=Phase.SYNC,
                           run_dir=tmp_path, run_id="r", config=config, weights="auto",
                           host="h", address="127.0.0.1", runtime=Runtime())

    try:
        assert rank_weights(actions.loop, ctx(0)) == [1.0, 1.0, 1.0]  # nothing measured: equal
        path = layout.metrics(tmp_path, 0, "rollout")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"samples_per_second": {"0": 40.0, "1": 20.0, "2": 20.0}}))
        weights = rank_weights(actions.loop, ctx(1))
        assert weights[0] == pytest.approx(2 * weights[1]) and weights[1] == weights[2]
    finally:
        actions.close()
