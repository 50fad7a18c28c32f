"""`coordinator doctor`: shared and coherent, or not, on real mounts with real processes.

- three nodes, each on its own sshfs client mount of one export, failed
  lookups cached for 3 s (what NFS's default lookupcache=all does): every
  node says the directory is shared, with the measured lags, and the
  new-file lag shows with its fix;
- three nodes given three different local directories under the same path
  (one mount namespace each, a bind mount of its own directory): every one
  exits 3 within its timeout, naming who it could not see;
- mount options read from mountinfo text: each risky one explained with its fix;
- the verdict's lines from given measurements: a listing that missed, a round
  broken off, free space short of the need.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.ops.doctor import Doctor
from coordinator.storage.mounts import Level, mount_of, risks
from tests.support.netfs import NetFs

TIMEOUT = 30  # per wait; a loaded 2-core box answers a probe in well under a second


def doctor_command(run_dir: Path, rank: int, *, timeout: float = TIMEOUT) -> list[str]:
    base = [sys.executable, "-m", "coordinator_cli", "doctor", "--run-dir", str(run_dir),
            "--timeout", str(timeout), "--need-gb", "0"]
    return [*base, "--master", "--num-nodes", "3"] if rank == 0 else [*base, "--worker",
                                                                       str(rank)]


def run_three(commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(c, p.returncode, o, "")
            for c, p, o in zip(commands, procs, outs, strict=True)]


@pytest.mark.slow
@pytest.mark.netfs
def test_three_nodes_on_their_own_network_mounts_are_shared_and_slow_lookups_named(
        tmp_path: Path) -> None:
    # Failed lookups cached for 3 s, like NFS's default lookupcache=all.
    with NetFs(tmp_path / "fs", mounts=3, negative_timeout_s=3.0) as fs:
        (fs.mounts[0] / "run").mkdir()
        done = run_three([doctor_command(fs.mounts[r] / "run", r) for r in range(3)], 240)
    for rank, d in enumerate(done):
        assert d.returncode == 0, (rank, d.stdout)
        assert "OK   shared: 3 node(s) see each other's files" in d.stdout, d.stdout
        assert "verdict: the directory can carry a run" in d.stdout
    master = done[0].stdout
    for kind in ("replace", "new", "list"):
        for rank in (1, 2):
            assert f"{kind:<7} rank {rank} " in master and "publish-to-visible ~" in master
    assert "fuse.sshfs: a FUSE filesystem" in master
    print(master)  # the measured lags, for the record
    # A file another node creates shows late, and the fix is named.
    new_lines = [line for line in master.splitlines() if " new     rank " in line]
    assert new_lines and all(line.strip().startswith("WARN") and "lookupcache=positive" in line
                             for line in new_lines), master


@pytest.mark.slow
def test_three_local_directories_under_one_path_are_not_shared(tmp_path: Path) -> None:
    """Each node sees its own directory at the same path: nobody sees anybody."""
    path = tmp_path / "shared"
    path.mkdir()
    commands = []
    for rank in range(3):
        own = tmp_path / f"node{rank}"
        own.mkdir()
        inner = " ".join(doctor_command(path, rank, timeout=5))
        commands.append(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                         f"mount --bind {own} {path} && exec {inner}"])
    started = time.monotonic()
    done = run_three(commands, 90)
    took = time.monotonic() - started
    assert [d.returncode for d in done] == [3, 3, 3], [d.stdout for d in done]
    assert took < 5 + 30, took  # the 5 s timeout, plus python start-up on a loaded box
    assert "FAIL shared: rank(s) [1, 2] never appeared in" in done[0].stdout
    for rank in (1, 2):
        assert f"FAIL shared: no round from the master naming rank {rank}" in done[rank].stdout
        assert "cannot carry a run" in done[rank].stdout
    assert not any((tmp_path / f"node{r}" / "doctor" / "result.json").exists() for r in (1, 2))


NFS_DEFAULT = ("50 30 0:48 / /shared rw,relatime shared:30 - nfs4 fs1:/export "
               "rw,vers=4.2,rsize=1048576,hard,proto=tcp,timeo=600,sec=sys\n")
NFS_POSITIVE = NFS_DEFAULT.replace("sec=sys", "sec=sys,lookupcache=pos")
NFS_NOCTO = NFS_POSITIVE.replace("hard", "hard,nocto,actimeo=600")
BLOB = "51 30 0:49 / /shared rw,nosuid shared:31 - fuse.blobfuse2 blobfuse2 rw,user_id=0\n"
S3 = "52 30 0:50 / /shared rw shared:32 - fuse.s3fs s3fs rw\n"


@pytest.mark.parametrize(("mountinfo", "expected"), [
    (NFS_DEFAULT, [(Level.WARN, "lookupcache=positive")]),
    (NFS_POSITIVE, []),
    (NFS_NOCTO, [(Level.WARN, "remove nocto"), (Level.WARN, "actimeo=60")]),
    (BLOB, [(Level.WARN, "block_cache")]),
    (S3, [(Level.FAIL, "put the run directory on NFS")]),
])
def test_risky_mount_options_are_explained_with_their_fix(
        mountinfo: str, expected: list[tuple[Level, str]]) -> None:
    mount = mount_of(Path("/shared/runs/exp1"), mountinfo)
    assert mount is not None and mount.mount_point == "/shared"
    found = risks(mount, num_nodes=3)
    assert [(r.level, fix) for r, (_, fix) in zip(found, expected, strict=True)
            if fix in r.fix] == [(level, fix) for level, fix in expected], found


def test_doctor_reports_a_mount_with_negative_lookups_cached_with_its_fix(
        tmp_path: Path) -> None:
    """One node on a (described) NFS mount with the default lookupcache: WARN and the fix."""
    lines: list[str] = []
    info = NFS_DEFAULT.replace("/shared", str(tmp_path))
    ok = Doctor(run_dir=tmp_path, rank=0, num_nodes=1, timeout_s=5, need_bytes=0,
                address="127.0.0.1", echo=lines.append, mountinfo=info).run()
    text = "\n".join(lines)
    assert ok, text
    assert "WARN mount   rank 0: NFS caches negative lookups" in text
    assert "fix: mount with lookupcache=positive" in text


def test_the_verdict_names_only_listings_that_missed_and_never_rounds_a_shortfall_away() -> None:
    """The verdict's figures from what the probes measured (doctor_verdict.judge).  A
    round broken off by a probe not seen in time leaves later probes unmade: that is
    the FAIL line's to say, not a listing that missed (every kind's short row was once
    reported as "did not show in a listing").  A list probe answered as unlisted is
    counted as such.  Free space short of --need-gb never rounds up to meet it."""
    from coordinator.ops.doctor_verdict import DoctorNode, Probed, judge

    nodes = {r: DoctorNode(rank=r, nonce="n", host=f"h{r}", pid=1, mount="nfs4 /x",
                           free_bytes=int(19.96 * 2**30), risks=()) for r in range(3)}
    broken = Probed(trips={"replace": {1: [0.01, 0.01], 2: [0.01]}, "new": {1: [0.01], 2: [0.01]},
                           "list": {1: [0.02], 2: [0.02]}},
                    reach={1: "", 2: ""}, clock_offset={1: 0.0, 2: 0.0},
                    failure="rank(s) [2] did not see probe 4 (replace) within 60 s")
    lines, ok = judge(nodes, broken, run_dir=Path("/x"), address="10.0.0.1",
                      need_bytes=20 * 2**30)
    assert not ok and lines[0].startswith("FAIL shared") and "probe 4" in lines[0]
    assert not [line for line in lines if "listing" in line], lines
    assert "WARN space   rank 0: 19.9 GiB free in the run directory, below the 20 GiB asked " \
        "for" in "\n".join(lines)

    unlisted = Probed(trips={"replace": {1: [0.01, 0.01]}, "new": {1: [0.01, 0.01]},
                             "list": {1: [0.02]}},
                      unlisted={1: 1}, reach={1: ""}, clock_offset={1: 0.0})
    lines, ok = judge({r: nodes[r] for r in (0, 1)}, unlisted, run_dir=Path("/x"),
                      address="10.0.0.1", need_bytes=int(0.5 * 2**30))
    assert ok, lines
    missed = [line for line in lines if "listing" in line]
    assert missed == [line for line in missed if line.startswith("INFO list    rank 1 (h1): "
                                                                  "1 of 2 new files")], lines
    assert len(missed) == 1, lines
    assert "OK   space   rank 0: 20.0 GiB free" in "\n".join(lines)
