"""A run directory in a bucket, on real servers: Azurite (Azure Blob) and moto (S3).

Every simulated node is a real `coordinator run` process with the credentials in
its environment and a TMPDIR of its own, so its node-local root is its own: a
file one node wrote can reach another only through the server.  Tests assert on
the objects in the bucket.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.records.phases import Phase
from coordinator.storage import bucket_url
from tests.support.buckets import Bucket, Server
from tests.support.cluster import LocalCluster, write_config
from tests.support.users import other_user

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 90.0  # a 2-iteration scripted run takes ~5 s; room for a loaded machine


class BucketCluster(LocalCluster):
    """LocalCluster whose run directory is a bucket URL; each rank its own node."""

    def __init__(self, bucket: Bucket, work: Path, **kwargs: Any) -> None:
        super().__init__(Path(bucket.url), work, **kwargs)
        self.bucket = bucket

    def command(self, rank: int, run_dir: Path | None = None) -> list[str]:
        cmd = super().command(rank, run_dir)
        cmd[cmd.index("--run-dir") + 1] = self.bucket.url
        return cmd

    def start(self, rank: int, command: list[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return super().start(rank, command, {**self.bucket.node_env(self.work, str(rank)),
                                             **(env or {})})

    def heartbeat(self, rank: int) -> dict[str, Any] | None:
        data = self.bucket.read(f"ranks/{rank}/heartbeat.json")
        return json.loads(data) if data else None


def cli(bucket: Bucket, tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator_cli", *args, "--run-dir", bucket.url],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp,
                          env=bucket.node_env(tmp, "cli"))


def arrivals(bucket: Bucket, iterations: int, ranks: int) -> set[tuple[int, int, int]]:
    found = set()
    for it in range(iterations):
        for phase in Phase:
            for rank in range(ranks):
                key = f"iterations/{it:06d}/phase-{int(phase):02d}/arrive-{rank}.json"
                if bucket.read(key) is not None:
                    found.add((it, int(phase), rank))
    return found


def test_three_ranks_run_every_phase_through_the_bucket_and_the_tools_read_it(
        server: Server, tmp_path: Path) -> None:
    """Three ranks, two iterations; mid-run an object is replaced by a foreign one;
    afterwards the tools read the URL, and a torn object is named by every reader."""
    bucket = server.bucket("three")
    config = write_config(tmp_path / "c.toml", iterations=2,
                          scripted='sleeps = ["0:0:1:2.0"]')
    c = BucketCluster(bucket, tmp_path, num_nodes=3, config=config)
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(0, 0, 1, "running"), 60, "rank 0 rolling out")
        # Rank 1's heartbeat replaced by one of another run: its next beat puts it
        # back, and nobody takes rank 1 for lost.
        hb = c.heartbeat(1)
        assert hb is not None
        bucket.put("ranks/1/heartbeat.json", json.dumps({**hb, "run_id": "otherrun0000"}).encode())
        codes = c.wait_all(timeout=RUN_TIMEOUT_S)
    finally:
        c.close()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
    assert arrivals(bucket, 2, 3) == {(it, int(p), r) for it in range(2) for p in Phase
                                      for r in range(3)}
    manifest = json.loads(bucket.read("run.json") or b"{}")
    for rank in range(3):
        log = c.output(rank)
        assert f"wake-ups: none in a bucket ({bucket.url})" in log
        assert "Traceback" not in log
        # Each daemon's log, its own lines only, reached the bucket as it exited.
        own = (bucket.read(f"ranks/{rank}/logs/daemon.log") or b"").decode()
        assert f"rank {rank} finished 2 iterations of run {manifest['run_id']}" in own
        records = [line for line in own.splitlines() if line[:2] == "20"]  # timestamped
        assert records and all(f" rank {rank} " in line for line in records), own[-2000:]
    assert f"new run {manifest['run_id']} in {bucket.url}:" in c.output(0)
    # No credential reached run.json, a record or a log line.
    for secret in bucket_url.secrets_in(bucket.env):
        assert secret not in json.dumps(manifest)
        assert not any(secret in c.output(r) for r in range(3))
    # The tools read the same URL from another "node".
    status = cli(bucket, tmp_path, "status")
    assert status.returncode == 0, status.stderr
    assert f"in {bucket.url}" in status.stdout and status.stdout.count("finished") == 3
    assert f"each rank's log: {bucket.url}/ranks/<R>/logs/daemon.log" in status.stdout
    timeline = cli(bucket, tmp_path, "timeline")
    assert timeline.returncode == 0 and "3 ranks, 2 iterations" in timeline.stdout
    # Rank 2's journal set back into iteration 1, as a rank lost in it leaves it: a
    # complete run has nothing to recover.
    journal = json.loads(bucket.read("ranks/2/journal.json") or b"{}")
    bucket.put("ranks/2/journal.json", json.dumps(
        {**journal, "completed_iteration": 0, "iteration": 1, "done": []}).encode())
    recover = cli(bucket, tmp_path, "recover", "--iteration", "1")
    assert recover.returncode == 0, recover.stderr
    assert bucket.read("iterations/000001/phase-13/release.json") is None  # removed
    assert json.loads(bucket.read("run.json") or b"{}")["generation"] == 1
    # A torn run.json: every reader names the object and exits 7, no traceback.
    bucket.put("run.json", b'{"schema": "coordinator/manifest", "ver')
    status = cli(bucket, tmp_path, "status")
    assert status.returncode == 7, status.stdout + status.stderr
    assert f"{bucket.url}/run.json" in status.stderr
    worker = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", bucket.url, "--worker", "1"],
        capture_output=True, text=True, timeout=60, env=bucket.node_env(tmp_path, "w"))
    assert worker.returncode == 7, worker.stdout + worker.stderr
    assert "run.json" in worker.stderr and "Traceback" not in worker.stderr


def test_a_worker_killed_with_wait_policy_is_restarted_and_the_run_completes(
        server: Server, tmp_path: Path) -> None:
    bucket = server.bucket("kill")
    config = write_config(tmp_path / "c.toml", iterations=2, on_failure="wait",
                          scripted='sleeps = ["2:0:1:1.5"]')
    c = BucketCluster(bucket, tmp_path, num_nodes=3, config=config)
    try:
        c.start_all()
        c.wait_until(lambda: c.at_phase(2, 0, 1, "running"), 60, "rank 2 rolling out")
        c.kill(2)
        survivors = {r: c.procs[r] for r in (0, 1)}
        time.sleep(1.0)
        c.start(2)
        codes = c.wait_all(timeout=RUN_TIMEOUT_S)
        assert all(p.returncode == 0 for p in survivors.values())
    finally:
        c.close()
    assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-2000:] for r in codes}
    history = json.loads(bucket.read("recoveries.json") or b"{}")["recoveries"]
    assert [(h["rank"], h["iteration"], h["phase"]) for h in history] == [(2, 0, 1)]
    # The killed action ran again to completion; nothing that completed ran twice.
    for it in range(2):
        for rank in range(3):
            for phase in (1, 10):
                key = f"iterations/{it:06d}/scripted/rank-{rank}/phase-{phase:02d}.json"
                assert json.loads(bucket.read(key) or b"{}").get("runs") == 1, key


def test_of_two_masters_started_at_once_exactly_one_runs(server: Server, tmp_path: Path
                                                         ) -> None:
    bucket = server.bucket("masters")
    config = write_config(tmp_path / "c.toml", iterations=1)
    c = BucketCluster(bucket, tmp_path, num_nodes=2, config=config)
    try:
        (tmp_path / "node-0b").mkdir()
        first = c.start(0)  # both import for ~1.5 s, then race to create run.json
        second = c.start(0, env={"TMPDIR": str(tmp_path / "node-0b")})
        deadline = time.monotonic() + 60
        while first.poll() is None and second.poll() is None:
            assert time.monotonic() < deadline, "neither master gave way"
            time.sleep(0.05)
        loser, winner = (first, second) if first.poll() is not None else (second, first)
        assert loser.returncode == 2
        assert winner.poll() is None  # it holds rank 0 and waits for rank 1
        assert json.loads(bucket.read("ranks/0/claim.json") or b"{}")["pid"] == winner.pid
        c.start(1)
        assert winner.wait(timeout=RUN_TIMEOUT_S) == 0
    finally:
        c.close()
    out = {p.pid: c.work / f"rank0-start{n}.log" for n, p in ((1, first), (2, second))}
    assert f"already held by pid {winner.pid}" in out[loser.pid].read_text()


def test_credentials_a_missing_container_and_no_server_exit_10_at_start(
        server: Server, tmp_path: Path) -> None:
    good = server.bucket("creds")
    missing = Bucket(url=good.url.replace("://runs/", "://nosuchcontainer/"), env=good.env,
                     server=server)
    cases = [(missing, "does not exist")]
    if server.kind == "azurite":  # moto accepts any key; Azurite checks the signature
        wrong = dict(good.env)
        wrong["AZURE_STORAGE_CONNECTION_STRING"] = wrong[
            "AZURE_STORAGE_CONNECTION_STRING"].replace("AccountKey=Eby8", "AccountKey=AAAA")
        cases.append((Bucket(url=good.url, env=wrong, server=server), "refused"))
    closed = {k: v.replace(str(server.port), "9") for k, v in good.env.items()}
    cases.append((Bucket(url=good.url, env=closed, server=server), "cannot be reached"))
    for bucket, why in cases:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "run", "--run-dir", bucket.url, "--master",
             "--num-nodes", "2"], capture_output=True, text=True, timeout=120,
            env=bucket.node_env(tmp_path, "m"))
        assert done.returncode == 10, (why, done.stdout + done.stderr)
        assert why in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert time.monotonic() - started < 60
        for secret in bucket_url.secrets_in(bucket.env):
            assert secret not in done.stdout + done.stderr
    assert good.read("run.json") is None  # nothing was written anywhere


def test_an_action_kind_not_declared_for_buckets_is_refused_before_anything_is_written(
        server: Server, tmp_path: Path) -> None:
    from tests.support.plugins import install_entry_points

    bucket = server.bucket("plain")
    site = install_entry_points(tmp_path / "site", "plain-kind", {
        "coordinator.actions": {"plain": "tests.support.plain_kind:KIND"}})
    root = Path(__file__).resolve().parents[2]
    env = {**bucket.node_env(tmp_path, "m"), "PYTHONPATH": f"{site}:{root}"}
    config = write_config(tmp_path / "c.toml", iterations=1)
    config.write_text(config.read_text().replace('actions = "scripted"', 'actions = "plain"'))
    done = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "2", "--config",
         str(config), "--run-dir", bucket.url], capture_output=True, text=True, timeout=120,
        env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"run.actions='plain' cannot run in a bucket run directory ({bucket.url})" \
        in done.stderr
    # Only the refusal the workers waiting for this master read (coordinator/machine/refusal.py):
    # nothing of a run, nothing the refused kind would have written by other means.
    assert bucket.store.listdir("") == ["master-refusal.json"]
    refusal = json.loads(bucket.store.read("master-refusal.json") or b"{}")
    assert "cannot run in a bucket run directory" in refusal["message"]


def test_doctor_checks_a_bucket_as_it_checks_a_directory(server: Server, tmp_path: Path
                                                         ) -> None:
    bucket = server.bucket("doctor")
    procs = []
    for rank in range(3):
        who = ["--master", "--num-nodes", "3"] if rank == 0 else ["--worker", str(rank)]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "coordinator_cli", "doctor", "--run-dir", bucket.url, "--timeout", "60",
             *who], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=bucket.node_env(tmp_path, str(rank))))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    master = outs[0]
    assert f"OK   shared: 3 node(s) see each other's files in {bucket.url}" in master
    assert "OK   exclusive create: a second create of the same name is refused" in master
    for kind in ("replace", "new", "list"):
        assert re.search(rf"OK   {kind} +rank 2 .*publish-to-visible ~\d+ ms", master), master
    assert "INFO mount   rank 1 (" in master and f"bucket {bucket.url}" in master
    assert "verdict: the directory can carry a run" in outs[1]


def test_another_local_user_cannot_make_a_bucket_run_fill_or_empty_their_symlink_target(
        azurite: Server, tmp_path: Path) -> None:
    """Finding 11's attack, as a second user of the node: in the /tmp both share, they
    make `coordinator-bucket-<our uid>` (open to all) and in it a symlink named by
    the hash of our URL (no secret: the URL is on `ps`) to a directory of ours.
    Our run refuses to start (exit 2), naming the directory; nothing of ours is
    written there, and nothing is removed."""
    if os.geteuid() != 0:
        pytest.fail("this test acts as a second user of the machine: run the suite as root")
    attacker = other_user()
    shared = Path(tempfile.mkdtemp(prefix="coordinator-shared-tmp-", dir="/tmp"))
    try:
        shared.chmod(0o1777)  # a node's /tmp
        ours = shared / "our-results"  # a directory of this user's the attacker names
        ours.mkdir()
        (ours / "eval.csv").write_text("0.91")
        bucket = azurite.bucket("attacked")
        trap = shared / f"coordinator-bucket-{os.getuid()}"
        digest = bucket_url.parse(bucket.url).digest
        planted = subprocess.run(
            ["runuser", "-u", attacker.pw_name, "--", "sh", "-c",
             f"mkdir -m 0777 {trap} && ln -s {ours} {trap / digest}"],
            capture_output=True, text=True, timeout=30)
        assert planted.returncode == 0, planted.stderr
        config = write_config(tmp_path / "c.toml", iterations=1)
        done = subprocess.run(
            [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "1", "--config",
             str(config), "--run-dir", bucket.url], capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S, env={**bucket.node_env(tmp_path, "m"), "TMPDIR": str(shared)})
        assert done.returncode == 2, done.stdout + done.stderr[-3000:]
        assert f"{trap} belongs to uid {attacker.pw_uid}, not to this user" in done.stderr
        assert "Traceback" not in done.stderr
        assert sorted(p.name for p in ours.iterdir()) == ["eval.csv"]
        assert (ours / "eval.csv").read_text() == "0.91"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
