"""The real RL loop with every node on its own client mount of one export.

The hf engine rolls out, the master aggregates, torchrun trains across the
three daemons and the checkpoint is published and served, with each node
seeing the run directory only through its own sshfs mount (tests/support/
netfs.py): with `direct_io` mounts (reads go to the server, as NFS's
close-to-open consistency promises; no mmap) and with plain caching mounts
(attributes and data cached, reads of a replaced file cut at the cached size
until the reader asks the server again).  In the asynchronous, disaggregated
loop nodes are SIGKILLed at phases 4, 6 and 10 and brought back by
`coordinator recover` and a restart of every node (on_failure "exit"), and a
rollout node and the training node are killed in phase 10 and brought back
alone, the others waiting (on_failure "wait").  When the fixture cannot be set up the test fails
with the reason: it never skips.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_rl_loop import check_two_iterations
from tests.support import reward_gate
from tests.support.cluster import LocalCluster
from tests.support.netfs import NetFs
from tests.support.reward_gate import RewardGate
from tests.support.sftp_gate import RenameGate
from tests.support.trainers import trainer_processes

pytestmark = [pytest.mark.slow, pytest.mark.netfs]
LEASE = 8.0  # sshfs on a loaded 2-core box: a beat can take a second or two

CONFIG = """
[run]
actions = "rl"
iterations = {iterations}

[schedule]
eval_interval = 1
eval_before_train = {eval_before_train}

[model]
path = "{model}"

[rollout]
group_size = 4
tasks_per_iteration = {tasks}
eval_tasks = 6
eval_group_size = 2
checkpoint_every_groups = {every}
concurrency = {concurrency}
max_tokens = {max_tokens}
keep_rank_files = true

[train]
mini_batch_size = 16
micro_batch_size = 64
lr = 3e-4
warmup_steps = 48
epochs = 3

[coordination]
heartbeat_interval_s = 0.5
lease_s = {lease}
join_timeout_s = 180.0
on_failure = "{on_failure}"
"""


def netfs_cluster(tmp_path: Path, fs: NetFs, model: Path, *, iterations: int = 2,
                  eval_before_train: bool = False, tasks: int = 12, every: int = 4,
                  concurrency: int = 4, max_tokens: int = 6,
                  weights: str = "1,1,1", on_failure: str = "exit",
                  master_args: tuple[str, ...] = (), run_keys: str = "",
                  gate: RewardGate | None = None) -> LocalCluster:
    """Three nodes, each on its own mount; with `gate`, node 2's reward calls wait for
    it (tests/support/reward_gate.py), every node scoring with the gate's file."""
    config = tmp_path / "rl.toml"
    text = CONFIG.replace("[run]\n", "[run]\n" + run_keys, 1).format(
        model=model, iterations=iterations, lease=LEASE, tasks=tasks, every=every,
        concurrency=concurrency, max_tokens=max_tokens, on_failure=on_failure,
        eval_before_train=str(eval_before_train).lower())
    reward: tuple[str, ...] = ()
    if gate is not None:  # its own deadline (600 s) comes before reward.timeout_s
        text += f'\n[reward]\npath = "{reward_gate.__file__}"\ntimeout_s = 900.0\n'
        # Node-local: the master's from its config, the workers' from their command line.
        reward = ("--set", f"reward.path={reward_gate.__file__}")
    config.write_text(text)
    (fs.mounts[0] / "run").mkdir()
    # The test reads records (heartbeats) on the server side, never through a
    # client's cache; each daemon gets its own mount's path (start_all).
    cluster = LocalCluster(fs.export / "run", tmp_path, num_nodes=3, config=config,
                           master_args=("--rank-weights", weights, *master_args),
                           worker_args=reward)
    cluster.mount_paths = [m / "run" for m in fs.mounts]  # type: ignore[attr-defined]
    if gate is not None:
        cluster.node_env[2] = gate.env
    return cluster


def start_all(c: LocalCluster) -> None:
    for rank in range(3):
        c.start(rank, c.command(rank, run_dir=c.mount_paths[rank]))  # type: ignore[attr-defined]


def test_three_nodes_train_two_iterations_each_on_its_own_mount(
    tmp_path: Path, warm_model: Path
) -> None:
    """direct_io mounts, nothing killed: every check of a completed run
    (test_rl_loop.check_two_iterations), the same engine process serving
    both iterations, and the timeline.  On caching mounts two iterations of
    the asynchronous loop run with three nodes killed and recovered along the
    way (test_async_nodes_killed_recover_and_restart_without_redoing_a_saved_chunk)."""
    with NetFs(tmp_path / "fs", mounts=3, direct_io=True) as fs:
        # keep 1: checkpoint 0 stays only as the best by eval/accuracy (iteration 1's
        # eval measures it), which check_two_iterations verifies.
        c = netfs_cluster(tmp_path, fs, warm_model, master_args=(
            "--set", "checkpoint.keep=1", "--set", "checkpoint.keep_best=eval/accuracy"))
        try:
            started = time.monotonic()
            start_all(c)
            codes = c.wait_all(timeout=900)
            elapsed = time.monotonic() - started
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            c.close()
        assert not any(trainer_processes(m) for m in c.mount_paths)  # type: ignore[attr-defined]
        check_two_iterations(fs.export / "run", tmp_path, samples=48, eval_samples=12,
                             eval_before_train=False, uninterrupted=True)
        check_best_kept_and_exported(fs.export / "run", c.mount_paths[1], tmp_path)  # type: ignore[attr-defined]
        print(f"\nRL loop, 3 nodes x 2 iterations on sshfs (direct_io): {elapsed:.0f} s")


def check_best_kept_and_exported(run: Path, mount: Path, tmp_path: Path) -> None:
    """checkpoint.keep_best's record, `coordinator status` showing it, and `coordinator
    export --best` from a client mount: the checkpoint's files but its manifest."""
    import subprocess

    from tests.integration.usage import coordinator

    accuracy = json.loads((run / "iterations/000001/metrics/eval.json").read_text())["accuracy"]
    best = json.loads((run / "checkpoints/best.json").read_text())
    assert (best["iteration"], best["evaluated_at"], best["value"]) == (0, 1, accuracy)
    status = subprocess.run([coordinator(), "status", "--run-dir", str(mount), "--json"],
                            capture_output=True, text=True, timeout=60)
    rows = json.loads(status.stdout)["iterations"]
    assert [r["checkpoint"] for r in rows] == [f"best ({accuracy:.4g})", "kept"], rows
    out = tmp_path / "best-model"
    done = subprocess.run([coordinator(), "export", "--run-dir", str(mount), "--best",
                           "eval/accuracy", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "iter-000000" in done.stdout, done.stderr
    source = run / "checkpoints/iter-000000"
    names = {p.name for p in source.iterdir()} - {"manifest.json"}
    assert {p.name for p in out.iterdir()} == names
    # Byte for byte, so the same logits (tests/rl/test_export.py loads exports to compare).
    assert all((out / n).read_bytes() == (source / n).read_bytes() for n in names)


# ---------------------------------------------------------------- kill, recover, restart


def chunks(export_run: Path) -> dict[Path, tuple[str, int]]:
    """Every chunk a rank manifest lists: (SHA-256, inode on the server)."""
    out = {}
    for manifest in export_run.glob("iterations/*/*/rank-*/manifest.json"):
        for entry in json.loads(manifest.read_text())["chunks"]:
            path = manifest.parent / entry["file"]
            out[path] = (entry["sha256"], path.stat().st_ino)
    return out


def engine_pid(export_run: Path, rank: int) -> int:
    return int(json.loads((export_run / f"ranks/{rank}/engine.json").read_text())["pid"])


def listed_chunks(manifest: Path) -> int:
    try:
        return len(json.loads(manifest.read_text())["chunks"])
    except (FileNotFoundError, ValueError):
        return 0


def hold_mid_rollout(c: LocalCluster, gate: RewardGate, manifest: Path,
                     phase: tuple[int, int] | None = None) -> None:
    """Hold node 2 (the gated node) once `manifest`, its rollout's, lists a chunk: it
    waits on its next reward call, so the kill that follows lands mid-rollout, with
    one group saved and the next not (tests/support/reward_gate.py says why this
    holds exactly where a stopped engine was a race).  Given `phase` (iteration,
    phase), then wait for the node's heartbeat to say so: the start of a phase
    rides on the next periodic beat (the daemon, waiting on its reward, keeps
    beating)."""
    gate.hold_when(lambda: listed_chunks(manifest) >= 1)
    c.wait_until(gate.holding, 600, f"node 2 scoring an answer after a chunk in {manifest}")
    if phase is not None:
        c.wait_until(lambda: c.at_phase(2, *phase), LEASE,
                     f"rank 2's heartbeat at iteration {phase[0]} phase {phase[1]}")
    assert listed_chunks(manifest) == 1 and not json.loads(manifest.read_text())["complete"]


def kill_node(c: LocalCluster, export_run: Path, rank: int,
              unblock: Callable[[], None] | None = None) -> None:
    """SIGKILL a node: its daemon and its engine (the engine dies with it on a real node).
    `unblock` runs between the signal and the reaping: a daemon blocked in a request
    the file server holds (tests/support/sftp_gate.py) dies once it is answered."""
    import os
    import signal

    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        pid = engine_pid(export_run, rank)
        os.kill(pid, signal.SIGKILL)
    c.procs[rank].send_signal(signal.SIGKILL)
    if unblock is not None:
        unblock()
    c.procs[rank].wait(timeout=30)


def recoveries(export_run: Path) -> int:
    try:
        return len(json.loads((export_run / "recoveries.json").read_text())["recoveries"])
    except (FileNotFoundError, ValueError):
        return 0


def restart_alone(c: LocalCluster, export_run: Path, killed: int, *, delay: float) -> None:
    """Restart only the killed node with its original command; the survivors, which
    never exit, re-form the group with it within lease + 5 s of the restart."""
    survivors = {r: p for r, p in c.procs.items() if r != killed}
    before = recoveries(export_run)
    time.sleep(delay)
    c.start(killed, c.command(killed, run_dir=c.mount_paths[killed]))  # type: ignore[attr-defined]
    restarted = time.monotonic()
    # The restarted daemon starts python, torch and the engine stack (~5 s on a
    # loaded 2-core box); sshfs adds a second or two per record it waits on.
    c.wait_until(lambda: recoveries(export_run) > before, LEASE + 5 + 15,
                 f"the group re-formed with rank {killed}")
    took = time.monotonic() - restarted
    print(f"\nrank {killed} restarted: the group resumed {took:.1f} s later")
    for rank, proc in survivors.items():
        assert proc.poll() is None, f"survivor {rank} exited:\n{c.output(rank)[-2000:]}"


def test_async_rollout_and_training_nodes_killed_rejoin_alone_redoing_no_saved_chunk(
    tmp_path: Path, warm_model: Path
) -> None:
    """on_failure "wait" on the asynchronous, disaggregated loop (node 0 trains,
    nodes 1-2 roll out, run.max_off_policy_steps = 1): rollout node 2 killed in
    phase 10 of iteration 0 while it rolls out iteration 1 ahead, restarted
    after its lease; then the training node (the master) killed in phase 10 of
    iteration 1 while it trains, restarted at once.  Each time only the killed
    node is restarted, the survivors never exit, the run completes, every chunk
    saved before a kill is kept as it was (same content, same file), every task
    is in its batch exactly once, and every batch is within one policy version.
    (The synchronous loop's nodes restarted alone: test_regroup.py with the
    scripted actions, test_rl_agent.py and test_resident_trainer.py with the
    real loop.)"""
    with NetFs(tmp_path / "fs", mounts=3) as fs, RewardGate(tmp_path / "gate") as gate:
        c = netfs_cluster(tmp_path, fs, warm_model, tasks=24, every=1, concurrency=1,
                          max_tokens=12, on_failure="wait",
                          run_keys='train_nodes = "0"\nmax_off_policy_steps = 1\n', gate=gate)
        run = fs.export / "run"
        saved: dict[Path, tuple[str, int]] = {}
        try:
            start_all(c)
            # Phase 10 of iteration 0: node 2 dies mid-way through iteration 1's
            # rollout; restarted after its lease, the group first sees a lost rank.
            hold_mid_rollout(c, gate, run / "iterations/000001/rollout/rank-2/manifest.json",
                             phase=(0, 10))
            saved |= chunks(run)
            kill_node(c, run, 2)
            gate.go_on()
            restart_alone(c, run, 2, delay=LEASE + 1)

            # Phase 10 of iteration 1: the training node dies while it trains.
            c.wait_until(lambda: c.at_phase(0, 1, 10), 600, "node 0 training iteration 1")
            saved |= chunks(run)
            kill_node(c, run, 0)
            restart_alone(c, run, 0, delay=1.0)

            codes = c.wait_all(timeout=900)
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            c.close()
        assert not any(trainer_processes(m) for m in c.mount_paths)  # type: ignore[attr-defined]
        final = chunks(run)
        redone = {p: v for p, v in saved.items() if final.get(p) != v}
        assert not redone, f"chunks saved before a kill were redone or lost: {redone}"
        history = json.loads((run / "recoveries.json").read_text())["recoveries"]
        assert [(h["rank"], h["iteration"]) for h in history] == [(2, 0), (0, 1)]
        assert history[0]["phase"] == 10 and history[1]["phase"] >= 10
        for it in (0, 1):
            rollout = json.loads((run / f"iterations/{it:06d}/metrics/rollout.json").read_text())
            # Every task exactly once in the batch (24 tasks x 4 samples), all of them
            # sampled by the initial policy: iteration 1's during iteration 0's training.
            assert rollout["num_samples"] == 96 and rollout["policy_versions"] == {"0": 96}
            assert rollout["staleness_max"] == it and rollout["stale_groups_dropped"] == 0
            assert (run / f"checkpoints/iter-{it:06d}/manifest.json").exists()
        assert not (run / "ranks/0/engine.json").exists()  # node 0 only trains


def stop_all_then_recover(c: LocalCluster, export_run: Path, killed: int, iteration: int,
                          phases: tuple[int, ...]) -> None:
    """After a node's SIGKILL the others exit 3 within lease + 5 s naming it and where
    it was; `coordinator recover` (the operator's one command, the iteration found
    from the journals) then clears the failed iteration, and every node starts again."""
    import re
    import subprocess
    import sys

    killed_at = time.monotonic()
    for rank in (r for r in range(3) if r != killed):
        code = c.wait(rank, timeout=LEASE + 5 + 15)
        assert code == 3, c.output(rank)[-2000:]
        found = re.search(rf"rank {killed} \(host [^)]+\) lost at iteration {iteration} "
                          r"phase (\d+)", c.output(rank))
        assert found and int(found[1]) in phases, c.output(rank)[-2000:]
    print(f"\nrank {killed} killed: the others stopped in {time.monotonic() - killed_at:.1f} s")
    done = subprocess.run([sys.executable, "-m", "coordinator_cli", "recover", "--run-dir",
                           str(c.mount_paths[0])],  # type: ignore[attr-defined]
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"recovering iteration {iteration}:" in done.stdout, done.stdout
    start_all(c)


def test_async_nodes_killed_recover_and_restart_without_redoing_a_saved_chunk(
    tmp_path: Path, warm_model: Path
) -> None:
    """on_failure "exit" on caching mounts (a reader's mount may hold a replaced
    file's old size), the path `coordinator recover` serves, in the asynchronous,
    disaggregated loop (node 0 trains, nodes 1-2 roll out, k = 1): rollout node 2
    killed mid-eval-rollout (phase 6), then in phase 10 mid-way through rolling
    out iteration 1 ahead, then the training node (the master) mid-aggregation
    (phase 4 of iteration 1).  Each time the others exit 3 naming the lost rank,
    `coordinator recover` runs, every node is started again; the run completes,
    every chunk saved before a kill (eval, and iteration 1's rolled out ahead)
    is kept as it was (same content, same file), and every task is in its batch
    exactly once, within one policy version."""

    renames = RenameGate(tmp_path / "renames")
    with NetFs(tmp_path / "fs", mounts=3, direct_io=False, rename_gate=renames.directory) as fs, \
            RewardGate(tmp_path / "gate") as gate:
        c = netfs_cluster(tmp_path, fs, warm_model, eval_before_train=True, tasks=24, every=1,
                          concurrency=1, max_tokens=12, weights="2,1,3", on_failure="exit",
                          run_keys='train_nodes = "0"\nmax_off_policy_steps = 1\n', gate=gate)
        # 12 eval tasks by rollout weights 0,1,3: rank 2 rolls out 9, a chunk per group.
        c.config.write_text(c.config.read_text().replace("eval_tasks = 6", "eval_tasks = 12"))
        run = fs.export / "run"
        it0, it1 = run / "iterations/000000", run / "iterations/000001"
        saved: dict[Path, tuple[str, int]] = {}
        try:
            start_all(c)
            # Phase 6: node 2 dies with part of its eval shard saved; its rewritten
            # manifest is what the master's merge read torn before (issue 8).
            hold_mid_rollout(c, gate, it0 / "eval/rank-2/manifest.json", (0, 6))
            saved |= chunks(run)
            kill_node(c, run, 2)
            gate.go_on()
            stop_all_then_recover(c, run, 2, 0, (6,))

            # Phase 10: node 2 dies with part of iteration 1's shard saved, rolled
            # out ahead while node 0 trains iteration 0.
            hold_mid_rollout(c, gate, it1 / "rollout/rank-2/manifest.json", (0, 10))
            saved |= chunks(run)
            kill_node(c, run, 2)
            gate.go_on()
            stop_all_then_recover(c, run, 2, 0, (10,))

            # Phase 4 of iteration 1: the master (the training node) is killed
            # with the train batch written to its temporary name, its rename held
            # at the file server (tests/support/sftp_gate.py), then dropped.  The
            # gate is armed at once: with iteration 1 rolled out ahead, phases 1-3
            # of it can pass between two heartbeats.
            assert it1.is_dir() and not (it1 / "batch.pt").exists()
            renames.arm("/iterations/000001/.batch.pt")
            c.wait_until(renames.held, 600, "the master publishing iteration 1's batch")
            assert renames.held_paths()[1].endswith("/iterations/000001/batch.pt")
            saved |= chunks(run)
            kill_node(c, run, 0, unblock=renames.drop)
            assert not (it1 / "batch.pt").exists()
            stop_all_then_recover(c, run, 0, 1, (3, 4))

            codes = c.wait_all(timeout=900)
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            renames.let_through()
            c.close()
        final = chunks(run)
        redone = {p: v for p, v in saved.items() if final.get(p) != v}
        assert not redone, f"chunks saved before a kill were redone or lost: {redone}"
        assert any("/eval/" in str(p) for p in saved), "no eval chunk was saved before a kill"
        assert any(str(it1) in str(p) for p in saved), "no chunk rolled out ahead was saved"
        assert not any(trainer_processes(m) for m in c.mount_paths)  # type: ignore[attr-defined]
        for it in (0, 1):
            base = run / f"iterations/{it:06d}"
            rollout = json.loads((base / "metrics/rollout.json").read_text())
            # Every task exactly once in the batch (24 tasks x 4 samples), none from
            # node 0, each at most one version behind.
            assert rollout["num_samples"] == 96 and rollout["staleness_max"] <= 1, rollout
            assert json.loads((base / "metrics/train.json").read_text())["samples"] == 96
            assert (run / f"checkpoints/iter-{it:06d}/manifest.json").exists()
            node_0 = json.loads((base / "rollout/rank-0/manifest.json").read_text())
            assert node_0["complete"] and node_0["chunks"] == []  # it has no tasks
        assert json.loads((it0 / "metrics/eval.json").read_text())["num_samples"] == 24
        assert not (run / "ranks/0/engine.json").exists()  # node 0 only trains


def test_chunks_on_a_direct_io_mount_verify_and_load_though_it_cannot_map_them(
    tmp_path: Path,
) -> None:
    """sshfs with direct_io refuses mmap (ENODEV): the SHA-256 check and the load
    read the file instead, and a restarted writer on another mount keeps every
    chunk (an I/O error or an unmappable file is never taken for damage)."""
    import mmap
    import os

    from rollout.chunk_format import read_verified_chunk
    from rollout.trajectory import RankCheckpointWriter
    from tests.rollout.test_trajectory import make_group

    with NetFs(tmp_path / "fs", mounts=2) as fs:
        a, b = (m / "rank-1" for m in fs.mounts)
        writer = RankCheckpointWriter(a, 1, 2, iteration=0)
        for i in range(6):
            writer.add_group(make_group(f"t/{i}"))
        writer.finalize()
        fd = os.open(b / "chunk-000000.pt", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as refused:
                mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            assert refused.value.errno == 19  # ENODEV: the case this test is about
        finally:
            os.close(fd)
        restarted = RankCheckpointWriter(b, 1, 2, iteration=0)
        assert restarted.load_completed_task_ids() == {f"t/{i}" for i in range(6)}
        for entry in restarted.manifest.chunks:
            chunk = read_verified_chunk(b / entry.file, entry)
            assert chunk.task_ids == entry.task_ids
