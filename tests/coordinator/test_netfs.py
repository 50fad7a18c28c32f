"""The multi-rank scenario with every rank on its own client mount of one export.

Each mount caches attributes, names and directory listings for 30 s, like an
NFS client; a barrier must still release within the polling ceiling plus
1 s, because waiters only open() files their writers announced.  When the
fixture cannot be set up the test fails with the reason: it never skips.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from coordinator.records.phases import Phase
from tests.support.cluster import LocalCluster, arrivals_on_disk, scripted_log, write_config
from tests.support.netfs import NetFs
from tests.support.sftp_gate import RenameGate

pytestmark = [pytest.mark.slow, pytest.mark.netfs]
POLL_CEILING_S = 0.5  # tests/support/cluster.py TEST_CONFIG


def test_the_mounts_really_cache_like_nfs_clients(tmp_path: Path) -> None:
    with NetFs(tmp_path / "fs", mounts=2) as fs:
        a, b = fs.mounts
        (a / "d").mkdir()
        assert os.listdir(b / "d") == []  # b caches this listing now
        (a / "d" / "new.json").write_text("{}")
        # Another client's new file is missing from the cached listing...
        assert os.listdir(b / "d") == []
        # ...but open()+read() goes to the server and finds it.
        assert (b / "d" / "new.json").read_text() == "{}"
        # A cached size hides growth from stat() for the attribute timeout.
        (a / "grow").write_text("x")
        assert (b / "grow").stat().st_size == 1
        (a / "grow").write_text("xxxxxxxx")
        assert (b / "grow").stat().st_size == 1


def test_the_server_holds_the_armed_rename_until_the_test_drops_it(tmp_path: Path) -> None:
    # The gate tests use to freeze a writer exactly before it publishes: the writer
    # blocks in rename(2); a dropped rename fails and never reaches the export,
    # and the gate fires once (the next rename of the same name goes through).
    import threading

    gate = RenameGate(tmp_path / "gate")
    with NetFs(tmp_path / "fs", mounts=2, rename_gate=gate.directory) as fs:
        a, b = fs.mounts
        (a / ".batch.pt.tmp").write_text("batch")
        (b / "other.tmp").write_text("other")
        gate.arm(".batch.pt")
        os.rename(b / "other.tmp", b / "other")  # not armed for it: goes through
        failed: list[BaseException] = []

        def publish() -> None:
            try:
                os.rename(a / ".batch.pt.tmp", a / "batch.pt")
            except OSError as exc:
                failed.append(exc)

        writer = threading.Thread(target=publish)
        writer.start()
        deadline = time.monotonic() + 30  # a loopback round trip, on a loaded machine
        while not gate.held() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.held(), "the armed rename never reached the gate"
        old, new = gate.held_paths()
        assert old.endswith("/.batch.pt.tmp") and new.endswith("/batch.pt")
        time.sleep(0.2)
        assert writer.is_alive() and not (fs.export / "batch.pt").exists()
        gate.drop()
        writer.join(timeout=30)
        assert not writer.is_alive() and len(failed) == 1, failed
        assert not (fs.export / "batch.pt").exists()
        assert (fs.export / ".batch.pt.tmp").read_text() == "batch"
        assert (fs.export / "other").read_text() == "other"
        os.rename(a / ".batch.pt.tmp", a / "batch.pt")  # fired once: through now
        assert (fs.export / "batch.pt").read_text() == "batch"


def test_three_ranks_on_three_client_mounts_complete_with_fast_barriers(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", iterations=3)
    with NetFs(tmp_path / "fs", mounts=3) as fs:
        (fs.mounts[0] / "run").mkdir()
        runs = [m / "run" for m in fs.mounts]
        c = LocalCluster(runs[0], tmp_path, num_nodes=3, config=config,
                         master_args=("--rank-weights", "2,1,1"))
        try:
            started = time.monotonic()
            for rank in range(3):
                c.start(rank, c.command(rank, run_dir=runs[rank]))
            codes = c.wait_all(timeout=180)
            elapsed = time.monotonic() - started
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
        finally:
            c.close()
        export = fs.export / "run"
        arrivals = arrivals_on_disk(export)
        all_steps = [(it, int(p)) for it in range(3) for p in Phase]
        for it, phase in all_steps:
            for rank in range(3):
                assert arrivals[(it, phase, rank)]["status"] == "ok"
        for rank in range(3):
            assert scripted_log(export, rank) == all_steps
        worst = 0.0
        for it in range(3):
            for rank in range(3):
                timings = json.loads((export / f"iterations/{it:06d}/timings/rank-{rank}.json")
                                     .read_text())
                for phase, t in timings["phases"].items():
                    worst = max(worst, t["wait_s"])
                    assert t["wait_s"] <= POLL_CEILING_S + 1.0, (
                        f"rank {rank} waited {t['wait_s']:.2f} s at iteration {it} phase {phase}"
                    )
        print(f"3 iterations on 3 sshfs mounts in {elapsed:.1f} s; longest barrier wait "
              f"{worst:.2f} s")


def _join_delay(tmp_path: Path, negative_timeout_s: float) -> float:
    """Workers start first and wait for the master; seconds from the master's
    start until every rank has joined its session, as seen on the server."""
    tmp_path.mkdir()
    config = write_config(tmp_path / "c.toml", iterations=1)
    with NetFs(tmp_path / "fs", mounts=3, negative_timeout_s=negative_timeout_s) as fs:
        (fs.mounts[0] / "run").mkdir()
        runs = [m / "run" for m in fs.mounts]
        c = LocalCluster(runs[0], tmp_path, num_nodes=3, config=config)
        export = fs.export / "run"
        try:
            for rank in (1, 2):
                c.start(rank, c.command(rank, run_dir=runs[rank]))
            # Both workers have looked up run.json and found nothing: with
            # lookupcache=all-like caching their clients now remember that.
            c.wait_until(lambda: all("waiting for the master" in c.output(r) for r in (1, 2)),
                         60, "both workers to wait for the master")
            started = time.monotonic()
            c.start(0, c.command(0, run_dir=runs[0]))

            def joined() -> bool:
                return all((hb := _heartbeat(export, r)) is not None and hb["state"] != "starting"
                           for r in range(3))

            c.wait_until(joined, negative_timeout_s + 90, "every rank to join")
            delay = time.monotonic() - started
            assert c.wait_all(timeout=120) == {0: 0, 1: 0, 2: 0}
        finally:
            c.close()
    return delay


def _heartbeat(run: Path, rank: int) -> dict | None:
    try:
        return json.loads((run / f"ranks/{rank}/heartbeat.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_workers_started_before_the_master_join_despite_cached_negative_lookups(
    tmp_path: Path,
) -> None:
    """NFS's default lookupcache=all remembers "no such file" for up to acdirmax;
    a worker that looked for run.json before the master wrote it sees it that
    much later.  Measured here with the fixture's negative cache at 10 s
    against none (lookupcache=positive); docs/PROTOCOL.md quotes the figures.
    Two lookups wait in turn: the workers' of run.json, then the master's of
    the workers' claims (it looked for them before they existed)."""
    positive = _join_delay(tmp_path / "positive", 0.0)
    negative = _join_delay(tmp_path / "negative", 10.0)
    print(f"\njoin after the master starts: {positive:.1f} s with no negative lookup cache, "
          f"{negative:.1f} s with a 10 s one")
    assert positive < 8.0
    assert 10.0 <= negative < 2 * 10.0 + 8.0
