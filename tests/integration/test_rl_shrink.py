"""coordination.on_failure "shrink" on the real loop, each node on its own sshfs mount.

Node 2 is SIGKILLed mid-rollout in iteration 0 (some of its chunks saved) and
not restarted: after shrink_after_s the master and node 1 go on.  Phase 0's
decision of the resumed iteration freezes what node 2 saved and gives its
other tasks to nodes 0 and 1 (rl/takeover.py); they roll them out, the master
merges every task exactly once, and torchrun trains on two nodes.  Node 2 is
then restarted with its original command and taken back at the next
iteration boundary it makes.  The resident trainer makes an iteration of this
run take about 2 s, a daemon's start about 5 (far more on a loaded machine),
so the master's rollout waits for the restarted daemon's first heartbeat: from
the iteration it is taken back at on, every iteration runs on three nodes
again, node 2 with its share of the tasks, and every one before it on the two
alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.train_batch import load_train_batch
from tests.integration.test_rl_netfs import (
    chunks,
    hold_mid_rollout,
    kill_node,
    netfs_cluster,
    recoveries,
    start_all,
)
from tests.support.cluster import LocalCluster
from tests.support.netfs import NetFs
from tests.support.reward_gate import RewardGate

pytestmark = [pytest.mark.slow, pytest.mark.netfs]
TASKS = 6  # 2 per node: node 2 is killed with 1 of its 2 saved
ITERATIONS = 4
GROUP = 4
SHRINK_AFTER_S = 3.0


def read(path: Path) -> dict:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def shrinking_cluster(tmp_path: Path, fs: NetFs, model: Path, gate: RewardGate, *,
                      iterations: int, tasks: int, run_keys: str = "") -> LocalCluster:
    return netfs_cluster(tmp_path, fs, model, iterations=iterations, tasks=tasks, every=1,
                         concurrency=1, max_tokens=12, on_failure="shrink", run_keys=run_keys,
                         gate=gate,
                         master_args=("--min-nodes", "2", "--set",
                                      f"coordination.shrink_after_s={SHRINK_AFTER_S}"))


def lose_node_2_then_restart_it(c: LocalCluster, gate: RewardGate, it_dir: Path, *,
                                phase: tuple[int, int] | None,
                                back_after: tuple[int, int] | None,
                                fresh_disk: Path | None = None,
                                member_gate: RewardGate | None = None,
                                ) -> tuple[dict, dict[Path, tuple[str, int]]]:
    """SIGKILL node 2 mid-rollout of `it_dir`'s train shard (at `phase`, if given),
    wait for the group to go on without it, restart it (once the master is past
    `back_after`, if given) and run to the end.  Returns the train plan as it was
    and node 2's chunks saved before the kill.  With `fresh_disk`, node 2 comes back
    with that empty directory as its TMPDIR: a replaced node, its cache gone.  With
    `member_gate` (a member's reward calls wait for it), that member's rollout of
    the iteration after `back_after`'s waits until the restarted daemon beats: node 2
    is taken back before the run ends however slowly it starts."""
    run = c.run_dir
    manifest = it_dir / "rollout/rank-2/manifest.json"
    try:
        start_all(c)
        hold_mid_rollout(c, gate, manifest, phase)
        planned = read(it_dir / "shard-train.json")
        saved = {p: v for p, v in chunks(run).items() if p.parent == manifest.parent}
        kill_node(c, run, 2)
        gate.go_on()
        c.wait_until(lambda: recoveries(run) == 1, 120, "the group going on without 2")
        if back_after is not None:
            c.wait_until(lambda: past(c, *back_after), 300,
                         f"the master past iteration {back_after[0]} phase {back_after[1]}")
        if fresh_disk is not None:
            fresh_disk.mkdir(mode=0o700)
        restarted: int | None = None
        if member_gate is not None:
            # The member's reward calls from the next iteration's plan on (written
            # at phase 0, before any rollout of it) wait for node 2's new daemon to
            # beat; the master, which takes a left-out rank back at an iteration's
            # last phase, cannot end the run without that rollout.  Unheld, a daemon
            # slower to start than the iterations left (about 2 s each) found the
            # run complete and did no work.
            assert back_after is not None
            plan = run / f"iterations/{back_after[0] + 1:06d}/shard-train.json"
            member_gate.hold_when(lambda: plan.exists() and not node_2_beats_as(c, restarted))
        restarted = c.start(2, c.command(2, run_dir=c.mount_paths[2]),  # type: ignore[attr-defined]
                            env=None if fresh_disk is None else {"TMPDIR": str(fresh_disk)}).pid
        if member_gate is not None:
            c.wait_until(lambda: node_2_beats_as(c, restarted), 300,
                         "node 2's restarted daemon beating")
            member_gate.go_on()
        codes = c.wait_all(timeout=900)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    return planned, saved


def node_2_beats_as(c: LocalCluster, pid: int | None) -> bool:
    hb = c.heartbeat(2)
    return hb is not None and pid is not None and hb["pid"] == pid


def check_taken_over(it_dir: Path, planned: dict, saved: dict[Path, tuple[str, int]]) -> dict:
    """Node 2's saved chunks of `it_dir` frozen as they were, its other tasks taken
    over, every planned task merged into the batch exactly once.  Returns the plan."""
    plan = read(it_dir / "shard-train.json")
    assert plan["frozen"] == [2]
    frozen = read(it_dir / "rollout/rank-2.frozen.json")
    assert {(it_dir / "rollout/rank-2" / e["file"], e["sha256"]) for e in frozen["chunks"]} == \
        {(p, sha) for p, (sha, _) in saved.items()}
    assert 0 < len(plan["assignments"][2]) < len(planned["assignments"][2])
    every = sorted(t for a in planned["assignments"] for t in a)
    assert sorted(merged_task_ids(it_dir, plan)) == every
    assert sorted(load_train_batch(it_dir / "batch.pt").group_task_ids) == every
    return plan


def merged_task_ids(it_dir: Path, plan: dict) -> list[str]:
    """Every task id the aggregation took, rank by rank: a frozen rank's from the
    master's copy of its manifest, the others' from their own."""
    out = []
    for rank, assigned in enumerate(plan["assignments"]):
        if not assigned:
            continue
        manifest = it_dir / (f"rollout/rank-{rank}.frozen.json" if rank in plan["frozen"]
                             else f"rollout/rank-{rank}/manifest.json")
        ids = [t for c in read(manifest)["chunks"] for t in c["task_ids"]]
        assert sorted(ids) == sorted(assigned), f"rank {rank}: {manifest}"
        out += ids
    return out


def test_a_lost_worker_is_left_out_its_tasks_taken_over_then_it_rejoins(
    tmp_path: Path, warm_model: Path
) -> None:
    iterations = ITERATIONS + 1  # back at iteration 3 or 4: the newest policy is a delta
    with NetFs(tmp_path / "fs", mounts=3) as fs, RewardGate(tmp_path / "gate") as gate, \
            RewardGate(tmp_path / "master-gate") as master_gate:
        c = shrinking_cluster(tmp_path, fs, warm_model, gate, iterations=iterations, tasks=TASKS)
        c.node_env[0] = master_gate.env
        run = fs.export / "run"
        it0 = run / "iterations/000000"
        # Restarted once the group is past iteration 2's start: taken back at the next
        # iteration boundary after its daemon is up, 3 or 4 (the master waits for it
        # in iteration 3's rollout).
        planned, saved = lose_node_2_then_restart_it(c, gate, it0, phase=None, back_after=(2, 0),
                                                     fresh_disk=tmp_path / "node-2-new-disk",
                                                     member_gate=master_gate)

        # Taking node 2 back is no failure: nobody took the master for gone meanwhile.
        assert "to re-form the group: no reason given" not in c.output(1), c.output(1)[-3000:]
        (recovery,) = read(run / "recoveries.json")["recoveries"]
        assert (recovery["rank"], recovery["iteration"], recovery["left_out"]) == (2, 0, [2])
        assert recovery["members"].keys() == {"0", "1"}

        # Iteration 0: node 2's saved chunks kept as they were, its other tasks
        # taken over, every planned task merged exactly once.
        check_taken_over(it0, planned, saved)
        assert read(it0 / "metrics/rollout.json")["num_samples"] == TASKS * GROUP

        # Node 2 worked from the boundary it was taken back at to the end, never before.
        timings = {int(p.parent.parent.name) for p in run.glob("iterations/*/timings/rank-2.json")}
        back = min(timings)
        assert 3 <= back < iterations and timings == set(range(back, iterations)), timings
        # Back on a new disk, its cache empty: the newest policy, a delta
        # (checkpoint.full_every 10), was made whole from the full base and the chain,
        # each link written into the copy of the one before in place (the engine's
        # cache keeps one model: trainer/local_copy.py advance).
        log = (run / "ranks/2/logs/daemon.log").read_text()
        for link in range(1, back):
            assert f"made iter-{link:06d} whole: its delta applied to iter-{link - 1:06d}'s " \
                f"copy in place (link {link} of the chain from iter-000000)" in log, log[-3000:]
        # Training ran on the members only, then on all three once 2 was back.
        sizes = [read(run / f"iterations/{it:06d}/metrics/train.json")["world_size"]
                 for it in range(iterations)]
        assert sizes == [2] * back + [3] * (iterations - back), (back, sizes)
        for it in range(1, iterations):
            plan_n = read(run / f"iterations/{it:06d}/shard-train.json")
            assert plan_n["frozen"] == []
            assert len(plan_n["assignments"][2]) == (TASKS // 3 if it >= back else 0), it
            assert sorted(merged_task_ids(run / f"iterations/{it:06d}", plan_n)) == sorted(
                t for a in plan_n["assignments"] for t in a)
        journal = read(run / "ranks/2/journal.json")
        assert journal["completed_iteration"] == iterations - 1


def test_async_a_rollout_node_lost_while_rolling_out_ahead_is_left_out_then_rejoins(
    tmp_path: Path, warm_model: Path
) -> None:
    """The asynchronous, disaggregated loop (node 0 trains, nodes 1-2 roll out, k = 1)
    under "shrink": node 2 is SIGKILLed in phase 10 of iteration 0 with part of
    iteration 1's shard, rolled out ahead, saved.  The group goes on without it;
    phase 0 of iteration 1 freezes what it saved of the kept plan and gives the
    rest to node 1, which rolls it out on the newer policy: iteration 1's batch
    holds every task once, within one version.  Restarted, node 2 is taken back
    at a boundary and rolls out from the first plan made after it (a plan is made
    one iteration ahead)."""
    iterations, tasks = 5, 6  # 3 tasks per rollout node
    with NetFs(tmp_path / "fs", mounts=3) as fs, RewardGate(tmp_path / "gate") as gate, \
            RewardGate(tmp_path / "node-1-gate") as node_1_gate:
        c = shrinking_cluster(tmp_path, fs, warm_model, gate, iterations=iterations, tasks=tasks,
                              run_keys='train_nodes = "0"\nmax_off_policy_steps = 1\n')
        c.node_env[1] = node_1_gate.env  # the other rollout node: node 0 only trains
        run = fs.export / "run"
        it1 = run / "iterations/000001"
        # Restarted once phase 0 of iteration 1 has shared out its tasks (taken
        # back sooner, it would roll them out itself).
        planned, saved = lose_node_2_then_restart_it(c, gate, it1, phase=(0, 10), back_after=(1, 0),
                                                     member_gate=node_1_gate)

        (recovery,) = read(run / "recoveries.json")["recoveries"]
        assert (recovery["rank"], recovery["iteration"], recovery["left_out"]) == (2, 0, [2])
        # Iteration 1: node 2's chunks rolled out ahead kept as they were, its other
        # tasks rolled out by node 1 (never by node 0, which only trains).
        plan = check_taken_over(it1, planned, saved)
        assert plan["assignments"][0] == []
        rollout = read(it1 / "metrics/rollout.json")
        # Rolled out ahead on version 0, taken over on version 1: within k = 1.
        assert rollout["num_samples"] == tasks * GROUP and rollout["staleness_max"] == 1
        assert set(rollout["policy_versions"]) == {"0", "1"}, rollout
        # Node 2 worked from the boundary it was taken back at; it rolls out from
        # the plan made at that boundary's phase 0, the next iteration's.
        timings = {int(p.parent.parent.name) for p in run.glob("iterations/*/timings/rank-2.json")}
        back = min(timings)
        assert 2 <= back < iterations and timings == set(range(back, iterations)), timings
        print(f"\nnode 2 taken back at iteration {back}")
        for it in range(2, iterations):
            plan_n = read(run / f"iterations/{it:06d}/shard-train.json")
            assert plan_n["frozen"] == [] and plan_n["assignments"][0] == []
            assert len(plan_n["assignments"][2]) == (tasks // 2 if it > back else 0), (it, back)
            assert sorted(merged_task_ids(run / f"iterations/{it:06d}", plan_n)) == sorted(
                t for a in plan_n["assignments"] for t in a)
        for it in range(iterations):
            train = read(run / f"iterations/{it:06d}/metrics/train.json")
            assert train["samples"] == tasks * GROUP and train["world_size"] == 1


def past(c: LocalCluster, iteration: int, phase: int) -> bool:
    hb = c.heartbeat(0)
    return hb is not None and (hb["iteration"], hb["phase"]) > (iteration, phase)
