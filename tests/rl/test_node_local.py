"""What a run keeps on a node's own disk (rl/node_local.py): per user, under
TMPDIR, removed by the last daemon of the run on the node."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.errors import UsageError
from rl import node_local

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "0123456789ab"


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(node_local, "_base", [])
    monkeypatch.setattr(node_local, "_joined", set())
    return tmp_path


def test_the_run_directory_is_per_user_under_tmpdir_and_the_last_holder_removes_it(
        own_tmpdir: Path) -> None:
    root = node_local.run_root(RUN_ID)
    assert root == own_tmpdir / f"coordinator-{os.getuid()}" / RUN_ID
    assert (own_tmpdir / f"coordinator-{os.getuid()}").stat().st_mode & 0o777 == 0o700
    (root / "iter-000001-abc").mkdir()
    with node_local.node_lock(node_local.lock_dir(root), "cache", timeout_s=5, what="x"):
        pass
    # Another daemon of the run on this node still holds it: it stays.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        started = int(psutil.Process(other.pid).create_time() * 1000)
        (root / node_local.HOLDERS / f"{other.pid}-{started}").touch()
        node_local.leave_all(keep=False)
        assert (root / "iter-000001-abc").is_dir()
    finally:
        other.kill()
        other.wait()
    # Its process gone, the next daemon to leave removes everything.
    node_local.run_root(RUN_ID)
    node_local.leave_all(keep=False)
    assert not root.exists() and not root.parent.exists()  # nothing left of this user


def test_keep_local_cache_keeps_it_and_a_run_id_that_is_not_one_is_refused() -> None:
    root = node_local.run_root(RUN_ID)
    node_local.leave_all(keep=True)
    assert root.is_dir() and not list((root / node_local.HOLDERS).iterdir())
    with pytest.raises(ValueError, match="run_id"):
        node_local.run_root("../etc")


def test_a_base_directory_another_user_owns_is_refused_naming_it(own_tmpdir: Path) -> None:
    base = own_tmpdir / f"coordinator-{os.getuid()}"
    base.mkdir()
    os.chown(base, 12345, 12345)
    with pytest.raises(UsageError, match=r"belongs to uid 12345.*point TMPDIR elsewhere"):
        node_local.node_base()


OTHER_USER = "coordinator-test"


def other_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        OTHER_USER], check=True, capture_output=True, timeout=60)
        return pwd.getpwnam(OTHER_USER)


def as_other_user(user: str, cmd: list[str], *, hide: Path) -> list[str]:
    """`cmd` run as `user`.  The interpreter, the virtual environment or this checkout
    may lie under a directory only root can enter (pyenv under /root, a CI
    workspace): then, in a mount namespace of the command's own, each such
    directory is a world-readable tmpfs holding just what the run needs."""
    needed = sorted({Path(p).resolve() for p in (sys.base_prefix, sys.prefix, ROOT)})
    steps: list[str] = []
    covered: set[Path] = set()
    for i, path in enumerate(needed):
        blocked = next((d for d in reversed(path.parents) if d != Path("/") and
                        not d.stat().st_mode & 0o001), None)
        if blocked is None:
            continue
        keep = hide / str(i)
        keep.mkdir(parents=True, exist_ok=True)
        steps.append(f"mount --bind {path} {keep}")
        covered.add(blocked)
    if not steps:
        return ["runuser", "-u", user, "--", *cmd]
    for blocked in sorted(covered, key=lambda d: len(d.parts)):
        steps.append(f"mount -t tmpfs -o mode=755 tmpfs {blocked}")
    for i, path in enumerate(needed):
        if (hide / str(i)).exists():
            steps.append(f"mkdir -p {path} && mount --bind {hide / str(i)} {path}")
    script = " && ".join(["mount --make-rprivate /", *steps,
                          f'exec runuser -u {user} -- "$@"'])
    return ["unshare", "-m", "sh", "-c", script, "sh", *cmd]


def one_node_run(run_dir: Path, tmpdir: Path, *, user: str | None, keep: bool) -> None:
    """The RL loop on one node, one small iteration, as `user` (None: this one)."""
    cmd = [sys.executable, "-m", "rl", "run", "--master", "--num-nodes", "1", "--log-path",
           str(run_dir), "--iterations", "1", "--eval-interval", "0",
           "--no-eval-before-train", "--set", "rollout.tasks_per_iteration=16",
           "--set", f"checkpoint.keep_local_cache={str(keep).lower()}"]
    if user is not None:
        cmd = as_other_user(user, cmd, hide=tmpdir.parent / "python-install")
    done = subprocess.run(cmd, env={**os.environ, "TMPDIR": str(tmpdir), "HOME": str(tmpdir)},
                          capture_output=True, text=True, timeout=240, cwd=tmpdir)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A directory the second user can reach (pytest's own are 0700 and root's)."""
    path = Path(tempfile.mkdtemp(prefix="coordinator-two-users-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_two_users_runs_on_one_node_each_leave_nothing_behind(world_tmp: Path,
                                                              tiny_model: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("this test creates a second user and runs as it: run the suite as root")
    user = other_user()
    tmp_path = world_tmp
    shared_tmp = tmp_path / "node-tmp"
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)  # a node's /tmp, shared by its users
    # The model each master would build, there already (seconds saved per run).
    shutil.copytree(tiny_model, tmp_path / "run-a" / "model-init")
    # The first user keeps their cache: the second user's run must not meet it.
    one_node_run(tmp_path / "run-a", shared_tmp, user=None, keep=True)
    mine = shared_tmp / f"coordinator-{os.getuid()}"
    kept = [p for p in mine.iterdir()]
    assert len(kept) == 1, kept  # one run directory, with one checkpoint copy in it
    assert len([c for c in kept[0].iterdir() if not c.name.startswith(".")]) == 1
    run_b = tmp_path / "run-b"
    shutil.copytree(tiny_model, run_b / "model-init")
    for path in (run_b, *run_b.rglob("*")):
        os.chown(path, user.pw_uid, user.pw_gid)
    one_node_run(run_b, shared_tmp, user=OTHER_USER, keep=False)
    # Nothing of theirs is left, and nothing else: what the engines and torchrun
    # left went with each run's directory (its .tmp was their TMPDIR).
    assert {p.name for p in shared_tmp.iterdir()} == {mine.name}
    assert mine.stat().st_uid == os.getuid()
