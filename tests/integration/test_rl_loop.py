"""The whole loop on 3 daemons: a trainer killed mid-training; a tampered checkpoint;
and what a completed 2-iteration run leaves on disk (check_two_iterations, for
the runs on network mounts in test_rl_netfs.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster import LocalCluster
from tests.support.trainers import trainer_processes

pytestmark = pytest.mark.slow
LEASE = 6.0

CONFIG = """
[run]
actions = "rl"
iterations = {iterations}

[schedule]
eval_interval = 1
eval_before_train = false

[model]
path = "{model}"

[rollout]
group_size = 4
tasks_per_iteration = 12
eval_tasks = 6
eval_group_size = 2
checkpoint_every_groups = 4
max_tokens = 6

[train]
mini_batch_size = 16
micro_batch_size = 64
lr = 3e-4
warmup_steps = 48
epochs = 3

[coordination]
heartbeat_interval_s = 0.5
lease_s = {lease}
on_failure = "{on_failure}"
join_timeout_s = 120.0
"""


def cluster(tmp_path: Path, model: Path, iterations: int,
            on_failure: str = "exit", epochs: int = 3) -> LocalCluster:
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(model=model, iterations=iterations, lease=LEASE,
                                    on_failure=on_failure).replace("epochs = 3",
                                                                   f"epochs = {epochs}"))
    return LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)


def check_two_iterations(run: Path, tmp_path: Path, *, samples: int, eval_samples: int,
                         eval_before_train: bool, uninterrupted: bool) -> None:
    """What a completed 2-iteration run of the real loop leaves on disk.

    The 3-node, 2-iteration runs on network mounts (tests/integration/
    test_rl_netfs.py, uninterrupted) and in a bucket (test_rl_bucket.py, a
    worker killed and restarted: `uninterrupted` False skips the checks of one
    engine process and a timeline without recoveries) call this.
    """
    from trainer.checkpoint import verify_checkpoint

    evaluated = [eval_before_train, True]
    for it in (0, 1):
        base = run / f"iterations/{it:06d}"
        assert json.loads((base / "metrics/rollout.json").read_text())["num_samples"] == samples
        # eval_interval 1: iteration 1 evaluates; iteration 0 with eval_before_train only.
        assert (base / "metrics/eval.json").exists() == evaluated[it]
        if evaluated[it]:
            evaluation = json.loads((base / "metrics/eval.json").read_text())
            assert evaluation["num_samples"] == eval_samples
            assert "staleness_max" not in evaluation and "num_dropped_groups" not in evaluation
        train = json.loads((base / "metrics/train.json").read_text())
        assert train["samples"] == samples
        manifest = verify_checkpoint(run / f"checkpoints/iter-{it:06d}")
        assert manifest.iteration == it
    # What the releases carry, typed (rl/contracts.py): the eval decision at
    # phase 5, the master's address and held port at phase 9, the checkpoint at 11.
    def payload(it: int, phase: int) -> dict:
        return json.loads((run / f"iterations/{it:06d}/phase-{phase:02d}/release.json")
                          .read_text())["payload"]

    assert [payload(it, 5)["eval"] for it in (0, 1)] == evaluated
    assert payload(0, 9)["train_port"] > 0 and payload(0, 9)["master_addr"]
    assert payload(0, 9)["start"] and payload(0, 9)["run"] == {"10": True}
    assert payload(1, 11)["checkpoint"] == "checkpoints/iter-000001"
    assert payload(0, 0)["policy"] == "initial"
    assert payload(1, 0)["policy"] == "checkpoints/iter-000000"
    # Iteration 1 trained from iteration 0's checkpoint; the optimizer steps carried on.
    job1 = json.loads((run / "iterations/000001/train/job.json").read_text())
    assert job1["model_dir"].endswith("checkpoints/iter-000000")
    t0 = json.loads((run / "iterations/000000/metrics/train.json").read_text())
    t1 = json.loads((run / "iterations/000001/metrics/train.json").read_text())
    assert t1["optimizer_step_start"] == t0["optimizer_step_end"] > 0
    weights = [verify_checkpoint(run / f"checkpoints/iter-{it:06d}") for it in (0, 1)]
    assert weights[0].files != weights[1].files
    # Iteration 1's checkpoint is a delta of iteration 0's, the full base
    # (checkpoint.full_every 10, trainer/delta.py): the trainer kept 0's files.
    assert weights[0].delta is None and weights[1].delta is not None
    assert (weights[1].delta.parent, weights[1].delta.parent_digest) == (
        "iter-000000", weights[0].digest)
    assert "delta/model.safetensors" in weights[1].files
    # Every node served iteration 1 from iteration 0's checkpoint.
    for rank in range(3):
        log = (run / f"ranks/{rank}/logs/hf_server.log").read_text()
        assert "iter-000000-" in log
    # TensorBoard has each iteration's scalars once, read back with tensorboard's reader.
    from tests.integration.test_rl_reporting import scalars

    board = scalars(run)
    for tag in ("rollout/reward_mean", "rollout/accuracy", "train/loss",
                "train/tokens_per_second", "phase_s/10_train"):
        assert [step for step, _ in board[tag]] == [0, 1], (tag, board.get(tag))
    assert "train/kl" not in board  # train.kl_coef 0: no reference model, no KL measured
    assert [step for step, _ in board["eval/accuracy"]] == [it for it in (0, 1) if evaluated[it]]
    # Eval drops no group and samples one policy: nothing of the batch's is reported.
    assert not {t for t in board if t.startswith("eval/") and t.split("/")[1] in (
        "num_dropped_groups", "staleness_max", "staleness_mean", "stale_groups_dropped")}
    assert [v for _, v in board["train/world_size"]] == [3.0, 3.0]
    if not uninterrupted:
        return
    # Iteration 1's policy was made from the copy of iteration 0's, in place
    # (the engine's cache keeps one model: trainer/local_copy.py advance), no clone:
    # by the one daemon that made it (the ranks here share one host, so one cache).
    logs = [(run / f"ranks/{rank}/logs/daemon.log").read_text() for rank in range(3)]
    made = [rank for rank, log in enumerate(logs) if "made iter-000001 whole: its delta "
            "applied to iter-000000's copy in place" in log]
    assert len(made) == 1, [log[-2000:] for log in logs]
    # Phase 7 put every engine to sleep and phase 12 reloaded the new checkpoint
    # into the same process: one engine pid per rank across both iterations,
    # and what it served matched the trainer's probe log-probabilities.
    def arrival(it: int, phase: int, rank: int) -> dict:
        return json.loads((run / f"iterations/{it:06d}/phase-{phase:02d}/arrive-{rank}.json")
                          .read_text())["payload"]

    # One trainer group for the whole session: started at iteration 0, kept at 1.
    assert not payload(1, 9)["start"] and payload(1, 9)["group"] == payload(0, 9)["group"]
    for rank in range(3):
        trained = [arrival(it, 10, rank) for it in (0, 1)]
        assert [t["trainer"] for t in trained] == ["started", "kept"], trained
        assert trained[0]["trainer_pid"] == trained[1]["trainer_pid"], trained
    for rank in range(3):
        slept = [arrival(it, 7, rank) for it in (0, 1)]
        served = [arrival(it, 12, rank) for it in (0, 1)]
        assert [s["engine"] for s in slept] == ["asleep", "asleep"], slept
        assert [s["engine"] for s in served] == ["reloaded", "reloaded"], served
        assert len({s["engine_pid"] for s in slept + served}) == 1, (slept, served)
        for s in served:
            assert 0 <= s["probe_mean_abs_diff"] <= s["probe_tolerance"], s
        # Consecutive checkpoints moved the probes by more than the tolerance:
        # the check can tell a stale engine from a fresh one on this model.
        assert served[1]["probe_moved"] > served[1]["probe_tolerance"], served[1]
    # The timeline has every rank's every phase of both iterations, action and wait.
    from coordinator.ops.timeline import SpanKind, load

    drawn = load(run)
    assert {(s.rank, s.iteration, s.phase, s.kind) for s in drawn.spans} == {
        (r, it, p, k) for r in range(3) for it in (0, 1) for p in range(14) for k in SpanKind}
    assert drawn.skipped == 0 and not drawn.recoveries
    for out in (tmp_path / "timeline.png", tmp_path / "timeline.html"):
        done = subprocess.run([sys.executable, "-m", "coordinator_cli", "timeline", "--run-dir", str(run),
                               "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "3 ranks, 2 iterations, 0 recoveries" in done.stdout
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "timeline.html").read_text()
    assert all(f"rank {r} iteration {it} phase {p} (" in page
               for r in range(3) for it in (0, 1) for p in range(14))


# Whole nodes killed on the real loop, with on_failure "wait" and with "exit"
# and `recover`: tests/integration/test_rl_netfs.py; scripted: tests/coordinator/.
@pytest.mark.parametrize("victim", ["trainer"])
def test_a_killed_trainer_or_node_stops_every_node_and_recover_reruns_training(
    tmp_path: Path, warm_model: Path, victim: str
) -> None:
    # 30 epochs: a job of a few seconds, so the kill lands in it, after its first line.
    c = cluster(tmp_path, warm_model, iterations=2, epochs=30)
    trainer_log = c.run_dir / "ranks/2/logs/trainer.log"
    try:
        c.start_all()
        c.wait_until(lambda: trainer_log.exists() and "[trainer it=1 rank=2/3] batch" in
                     trainer_log.read_text(), 600, "node 2's trainer in iteration 1")
        if victim == "trainer":
            trainer_processes(c.run_dir, 2)[0].kill()
        else:
            c.procs[2].kill()  # the whole node: its daemon, torchrun and trainer go down
        killed = time.monotonic()
        survivors = [0, 1, 2] if victim == "trainer" else [0, 1]
        for rank in survivors:
            code = c.wait(rank, timeout=LEASE + 5 + 10)
            took = time.monotonic() - killed
            assert took <= LEASE + 5, f"rank {rank} needed {took:.1f} s to stop"
            if victim == "trainer":
                assert code == 4, c.output(rank)[-2000:]
                assert re.search(r"rank 2 .*failed iteration 1 phase 10 \(train\).*rank 2: "
                                 r"(trainer process 0 \(pid \d+\) closed its connection|"
                                 r"torchrun killed by SIGKILL)", c.output(rank)), \
                    c.output(rank)[-2000:]
            else:
                assert code == 3, c.output(rank)[-2000:]
                assert re.search(r"rank 2 \(host [^)]+\) lost at iteration 1 phase 10 \(train\)",
                                 c.output(rank)), c.output(rank)[-2000:]
        time.sleep(1.0)
        assert not trainer_processes(c.run_dir), "every node stopped its torchrun"

        out = subprocess.run([sys.executable, "-m", "coordinator_cli", "recover", "--run-dir",
                              str(c.run_dir), "--iteration", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        c.start_all()
        codes = c.wait_all(timeout=600)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        # Training of iteration 1 was rerun from iteration 0's checkpoint.
        job = json.loads((c.run_dir / "iterations/000001/train/job.json").read_text())
        assert job["model_dir"].endswith("checkpoints/iter-000000")
        assert (c.run_dir / "checkpoints/iter-000001/manifest.json").exists()
        # The rollout of iteration 1, finished before the kill, was not redone.
        assert "already done (journal), not redone" in c.output(1)
    finally:
        c.close()


def test_a_checkpoint_altered_after_publishing_is_refused_at_phase_12_naming_the_file(
    tmp_path: Path, warm_model: Path
) -> None:
    import shutil

    from coordinator.errors import ActionError
    from coordinator.machine.actions import StepContext, resolve_config
    from coordinator.machine.runtime import Runtime
    from coordinator.records.phases import Phase
    from rl.actions import build

    run = tmp_path / "run"
    published = run / "checkpoints/iter-000000"
    shutil.copytree(warm_model, published)
    weights = published / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    config = resolve_config({"run": {"actions": "rl"}, "model": {"path": str(warm_model)},
                             "checkpoint": {"local_cache": str(tmp_path / "cache")}})
    actions = build(config, rank=1, num_nodes=3, run_dir=run)
    ctx = StepContext(rank=1, num_nodes=3, iteration=0, phase=Phase.RESTART_ENGINE, run_dir=run,
                      run_id="0123456789ab", config=config, weights=(1.0, 1.0, 1.0), host="h",
                      address="127.0.0.1", runtime=Runtime(),
                      releases={11: {"checkpoint": "checkpoints/iter-000000"}})
    try:
        with pytest.raises(ActionError, match=r"model\.safetensors"):
            actions.run(Phase.RESTART_ENGINE, ctx)
    finally:
        actions.close()
