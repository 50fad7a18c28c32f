"""The real RL loop with every node on its own client mount of one export.

The hf engine rolls out, the master aggregates, torchrun trains across the
three daemons and the checkpoint is published and served, with each node
seeing the run directory only through its own sshfs mount (tests/support/
netfs.py): with plain caching mounts (attributes and data cached, reads of
a replaced file cut at the cached size until the reader asks the server
again), and, in the kill-and-rejoin test, with `direct_io` mounts (reads go
to the server, as NFS's close-to-open consistency promises).  When the
fixture cannot be set up the test fails with the reason: it never skips.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.core.cluster import LocalCluster
from tests.support.netfs import NetFs

pytestmark = [pytest.mark.slow, pytest.mark.netfs]
LEASE = 8.0  # sshfs on a loaded 2-core box: a beat can take a second or two

CONFIG = """
[run]
actions = "rl"
iterations = {iterations}
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
                  master_args: tuple[str, ...] = ()) -> LocalCluster:
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(
        model=model, iterations=iterations, lease=LEASE, tasks=tasks, every=every,
        concurrency=concurrency, max_tokens=max_tokens, on_failure=on_failure,
        eval_before_train=str(eval_before_train).lower()))
    (fs.mounts[0] / "run").mkdir()
    cluster = LocalCluster(fs.mounts[0] / "run", tmp_path, num_nodes=3, config=config,
                           master_args=("--rank-weights", weights, *master_args))
    cluster.mount_paths = [m / "run" for m in fs.mounts]  # type: ignore[attr-defined]
    return cluster


def start_all(c: LocalCluster) -> None:
    for rank in range(3):
        c.start(rank, c.command(rank, log_path=c.mount_paths[rank]))  # type: ignore[attr-defined]


# Plain caching mounts only: the direct_io mode (reads reach the server, as NFS's
# close-to-open promises) carries the real loop in the kill-and-rejoin test below
# and in tests/integration/test_rl_shrink.py.
@pytest.mark.parametrize("direct_io", [False], ids=["caching"])
def test_three_nodes_train_two_iterations_each_on_its_own_mount(
    tmp_path: Path, warm_model: Path, direct_io: bool
) -> None:
    from trainer.checkpoint import verify_checkpoint

    with NetFs(tmp_path / "fs", mounts=3, direct_io=direct_io) as fs:
        c = netfs_cluster(tmp_path, fs, warm_model)
        try:
            started = time.monotonic()
            start_all(c)
            codes = c.wait_all(timeout=900)
            elapsed = time.monotonic() - started
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            c.close()
        run = fs.export / "run"
        for it in (0, 1):
            base = run / f"iterations/{it:06d}"
            assert json.loads((base / "metrics/rollout.json").read_text())["num_samples"] == 48
            assert json.loads((base / "metrics/train.json").read_text())["samples"] == 48
            assert verify_checkpoint(run / f"checkpoints/iter-{it:06d}").iteration == it
        assert json.loads((run / "iterations/000001/metrics/eval.json").read_text())[
            "num_samples"] == 12
        for rank in range(3):
            log = (run / f"ranks/{rank}/logs/hf_server.log").read_text()
            assert "iter-000000-" in log  # iteration 1 was served from iteration 0's checkpoint
        mode = "direct_io" if direct_io else "caching"
        print(f"\nRL loop, 3 nodes x 2 iterations on sshfs ({mode}): {elapsed:.0f} s")


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


def freeze_mid_rollout(c: LocalCluster, export_run: Path, rank: int, manifest: Path) -> None:
    """SIGSTOP the rank's engine once its manifest lists a chunk, so the kill that
    follows lands mid-rollout: some chunks saved, others not yet generated."""
    import os
    import signal

    c.wait_until(lambda: listed_chunks(manifest) >= 1, 600, f"a chunk in {manifest}")
    os.kill(engine_pid(export_run, rank), signal.SIGSTOP)
    assert not json.loads(manifest.read_text())["complete"], "the rollout finished too soon"


def kill_node(c: LocalCluster, export_run: Path, rank: int) -> None:
    """SIGKILL a node: its daemon and its engine (the engine dies with it on a real node)."""
    import contextlib
    import os
    import signal

    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        pid = engine_pid(export_run, rank)
        os.kill(pid, signal.SIGKILL)
    c.kill(rank)


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
    c.start(killed, c.command(killed, log_path=c.mount_paths[killed]))  # type: ignore[attr-defined]
    restarted = time.monotonic()
    # The restarted daemon starts python, torch and the engine stack (~5 s on a
    # loaded 2-core box); sshfs adds a second or two per record it waits on.
    c.wait_until(lambda: recoveries(export_run) > before, LEASE + 5 + 15,
                 f"the group re-formed with rank {killed}")
    took = time.monotonic() - restarted
    print(f"\nrank {killed} restarted: the group resumed {took:.1f} s later")
    for rank, proc in survivors.items():
        assert proc.poll() is None, f"survivor {rank} exited:\n{c.output(rank)[-2000:]}"


def test_killed_workers_and_master_rejoin_alone_without_redoing_a_saved_chunk(
    tmp_path: Path, warm_model: Path
) -> None:
    """on_failure "wait" on the real loop: a worker killed mid-rollout (phase 1)
    and mid-training (phase 10), the master killed mid-rollout (phase 1 of
    iteration 1): each time only the killed node is restarted, nobody types a
    command, the survivors never exit, the run completes, and every chunk
    saved before a kill is kept as it was (same content, same file): at most
    one checkpoint interval (one group here) is redone per kill."""
    with NetFs(tmp_path / "fs", mounts=3) as fs:
        c = netfs_cluster(tmp_path, fs, warm_model, tasks=24, every=1, concurrency=1,
                          max_tokens=12, weights="2,1,3", on_failure="wait")
        run = fs.export / "run"
        saved: dict[Path, tuple[str, int]] = {}
        try:
            start_all(c)
            # Phase 1: node 2 dies with part of its train shard saved; restarted
            # before its lease ends, the group sees a new incarnation.
            freeze_mid_rollout(c, run, 2, run / "iterations/000000/rollout/rank-2/manifest.json")
            saved |= chunks(run)
            kill_node(c, run, 2)
            restart_alone(c, run, 2, delay=1.0)

            # Phase 10: node 2 dies while its trainer runs; restarted after its
            # lease, the group first sees a lost rank.
            c.wait_until(lambda: c.at_phase(2, 0, 10) and (run / "ranks/2/logs/"
                         "train-iter-000000.log").exists(), 600, "node 2 training")
            saved |= chunks(run)
            kill_node(c, run, 2)
            restart_alone(c, run, 2, delay=LEASE + 1)

            # Phase 1 of iteration 1: the master dies mid-rollout.
            freeze_mid_rollout(c, run, 0, run / "iterations/000001/rollout/rank-0/manifest.json")
            saved |= chunks(run)
            kill_node(c, run, 0)
            restart_alone(c, run, 0, delay=1.0)

            codes = c.wait_all(timeout=900)
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            c.close()
        final = chunks(run)
        redone = {p: v for p, v in saved.items() if final.get(p) != v}
        assert not redone, f"chunks saved before a kill were redone or lost: {redone}"
        history = json.loads((run / "recoveries.json").read_text())["recoveries"]
        # The start of a phase rides on the next periodic beat (PROTOCOL.md,
        # liveness): a master killed within 0.5 s of starting phase 1 is
        # reported where its peers last saw it, phase 0 of iteration 1.
        assert [(h["rank"], h["iteration"]) for h in history] == [(2, 0), (2, 0), (0, 1)]
        assert [h["phase"] for h in history][:2] == [1, 10] and history[2]["phase"] in (0, 1)
        assert [h["resume_iteration"] for h in history] == [0, 0, 1]
        for it in (0, 1):
            # Every task exactly once in the batch: 24 tasks x 4 samples.
            assert json.loads((run / f"iterations/{it:06d}/metrics/rollout.json").read_text())[
                "num_samples"] == 96
            assert (run / f"checkpoints/iter-{it:06d}/manifest.json").exists()


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
