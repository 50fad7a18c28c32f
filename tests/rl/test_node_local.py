"""What a run keeps on a node's own disk (rl/node_local.py): per user, under
TMPDIR, removed by the last daemon of the run on the node."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import ActionError, UsageError
from coordinator.storage import bucket_url, objstore
from coordinator.storage.private_dir import PrivateDirError
from rl import node_local
from tests.support.users import OTHER_USER, as_other_user, other_user

RUN_ID = "0123456789ab"


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(node_local, "_anchor", [])
    monkeypatch.setattr(node_local, "_joined", {})
    monkeypatch.setattr(node_local, "_adopted", [])
    return tmp_path


def test_the_run_directory_is_per_user_under_tmpdir_and_the_last_holder_removes_it(
        own_tmpdir: Path) -> None:
    root = node_local.run_root(RUN_ID)
    assert root == own_tmpdir / f"coordinator-{os.getuid()}" / RUN_ID
    assert (own_tmpdir / f"coordinator-{os.getuid()}").stat().st_mode & 0o777 == 0o700
    (root / "iter-000001-abc").mkdir()
    with node_local.node_lock(node_local.lock_dir(root), "cache", timeout_s=5, what="x"), \
            pytest.raises(ActionError, match=r"waited 0.1 s for another process on this node "
                          r"to finish copying a checkpoint \(lock file .*/\.locks/cache\.lock\)"), \
            node_local.node_lock(root / node_local.LOCKS, "cache", timeout_s=0.1,
                                 what="copying a checkpoint"):
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
    with pytest.raises(UsageError, match=r"belongs to uid 12345, not to this user.*remove it, or point TMPDIR"):
        node_local.node_base()


def test_a_directory_removed_under_its_daemon_is_named_with_the_cause_and_made_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not a traceback such as FileNotFoundError: .../.locks/cache.lock (finding 13)."""
    root = node_local.run_root(RUN_ID)
    locks = node_local.lock_dir(root)
    shutil.rmtree(root)  # a TMPDIR cleaner, or someone by hand
    cause = rf"{root} vanished while this daemon held it: .*a TMPDIR cleaner such as "
    with pytest.raises(ActionError, match=cause), \
            node_local.node_lock(locks, "cache", timeout_s=5, what="copying a checkpoint"):
        pass
    with pytest.raises(ActionError, match=cause):
        node_local.lock_dir(root)
    # Its next use makes it again, registered, saying why it had to.
    with caplog.at_level(logging.WARNING, logger=node_local.__name__):
        assert node_local.run_root(RUN_ID) == root
    assert f"{root} vanished while this daemon held it" in caplog.text
    assert (root / node_local.HOLDERS / node_local._me()).is_file()
    with node_local.node_lock(node_local.lock_dir(root), "cache", timeout_s=5, what="x"):
        pass
    node_local.leave_all(keep=False)
    assert not root.parent.exists()


@pytest.mark.parametrize("made_again", [False, True], ids=["by-filelock", "at-once"])
def test_a_lock_directory_that_vanishes_as_the_lock_is_taken_is_named_not_made_again(
        monkeypatch: pytest.MonkeyPatch, made_again: bool) -> None:
    """filelock makes a missing parent again (mode 0755 under the umask): the node
    lock tells a directory removed between its look and the lock by its inode,
    removes what filelock made and names the vanishing.  A directory of the same name
    made again at once (`at-once`: by another process, or filelock's own makedirs of
    only that directory) gets the removed one's inode number on ext4 (in 1,931 of
    2,000 tries on this machine) unless the look still holds the old one open: a
    comparison of two stat()s, as the lock made it until 2026-11-28, let this one
    pass in every try, and failed the by-filelock case twice in about fifteen runs
    of this file beside tests/trainer/test_delta.py on two xdist workers."""
    import filelock

    root = node_local.run_root(RUN_ID)
    locks = node_local.lock_dir(root)
    acquire = filelock.FileLock.acquire

    def cleaner_first(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The cleaner strikes between the look and the lock.
        shutil.rmtree(locks if made_again else root)
        if made_again:
            locks.mkdir()
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(filelock.FileLock, "acquire", cleaner_first)
    with pytest.raises(ActionError, match=rf"{root} vanished while this daemon held it"), \
            node_local.node_lock(locks, "cache", timeout_s=5, what="copying a checkpoint"):
        pass
    assert not locks.exists()  # nothing left that is open to others
    monkeypatch.undo()
    node_local.leave_all(keep=False)


def test_a_lock_directory_swapped_for_a_symlink_is_refused_naming_it(own_tmpdir: Path) -> None:
    """A node lock is never taken through a symlink planted where the run's lock
    directory was: the error names the path, and the symlink's target gets no lock file."""
    root = node_local.run_root(RUN_ID)
    locks = node_local.lock_dir(root)
    elsewhere = own_tmpdir / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(locks)
    locks.symlink_to(elsewhere)
    with pytest.raises(ActionError, match=rf"{locks} is no longer a directory \(a symlink"), \
            node_local.node_lock(locks, "cache", timeout_s=5, what="copying a checkpoint"):
        pass
    assert list(elsewhere.iterdir()) == []
    locks.unlink()
    node_local.leave_all(keep=False)


def test_a_planted_symlink_is_refused_and_leaving_never_empties_its_target(
        own_tmpdir: Path) -> None:
    """Finding 11 as the issue reproduced it: hold() and leave_all() on a symlink where
    a bucket's local root belongs.  Both refuse it, and the directory it points to
    keeps every file; so does a root swapped for a symlink while it was held."""
    victim = own_tmpdir / "victim"
    victim.mkdir()
    (victim / "results.csv").write_text("1,2,3")
    place = objstore.local_dir(bucket_url.parse("az://runs/exp1"))
    place.path.parent.mkdir(mode=0o700)
    place.path.symlink_to(victim)
    with pytest.raises(PrivateDirError, match=f"{place.path} is a symlink"):
        node_local.hold(place)
    node_local.leave_all(keep=False)
    place.path.unlink()
    root = node_local.hold(place)
    (root / "fetched.json").write_text("{}")
    root.rename(own_tmpdir / "aside")
    root.symlink_to(victim)
    node_local.leave_all(keep=False)
    assert sorted(p.name for p in victim.iterdir()) == ["results.csv"]
    assert root.is_symlink()


def one_node_run(run_dir: Path, tmpdir: Path, *, user: str | None, keep: bool) -> None:
    """The RL loop on one node, one small iteration, as `user` (None: this one)."""
    cmd = [sys.executable, "-m", "coordinator_cli", "run", "--master", "--num-nodes", "1", "--run-dir",
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


# --- Daemons of one run on one node, registering and leaving at once -----------------

FORK = multiprocessing.get_context("fork")
CHILD_TIMEOUT_S = 60.0  # a forked child does milliseconds of work; room for a loaded machine
# How long the leaving daemon waits, between its count of live holders and its removal,
# for the other one to register: long enough for a registration nothing keeps out
# (milliseconds), short enough for the test.
PAUSE_S = 1.5


def _quiet_or_fail() -> list[logging.LogRecord]:
    """The warnings and errors node_local logs in this (child) process."""
    caught: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record)

    logger = logging.getLogger(node_local.__name__)
    logger.addHandler(Catch(level=logging.WARNING))
    logger.setLevel(logging.INFO)
    return caught


def _leave_after_pausing(checked: Any, registered: Any) -> None:
    node_local.run_root(RUN_ID)
    count = node_local._live_holders

    def paused(*args: Any) -> Any:
        live = count(*args)
        checked.set()
        registered.wait(PAUSE_S)
        return live

    node_local._live_holders = paused  # type: ignore[assignment]
    caught = _quiet_or_fail()
    node_local.leave_all(keep=False)
    os._exit(1 if caught else 0)


def _join_then_leave(checked: Any, registered: Any, report: Path, go: Any) -> None:
    checked.wait(CHILD_TIMEOUT_S)
    root = node_local.run_root(RUN_ID)
    report.write_text(str(root / node_local.HOLDERS / node_local._me()))
    registered.set()
    go.wait(CHILD_TIMEOUT_S)
    caught = _quiet_or_fail()
    node_local.leave_all(keep=False)
    os._exit(1 if caught else 0)


def _finish(proc: Any) -> int:
    proc.join(CHILD_TIMEOUT_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"a child did not finish within {CHILD_TIMEOUT_S} s")
    return int(proc.exitcode)


def test_a_daemon_registering_while_the_last_holder_leaves_keeps_the_directory(
        own_tmpdir: Path) -> None:
    """The interleaving of finding 13, forced: the leaving daemon has counted no live
    holder and is about to remove the directory when another daemon of the run on
    this node registers.  That one must find its directory (and its registration)
    there afterwards, and remove it when it leaves in turn."""
    checked, registered, go = FORK.Event(), FORK.Event(), FORK.Event()
    report = own_tmpdir / "joiner-holder"
    leaver = FORK.Process(target=_leave_after_pausing, args=(checked, registered))
    joiner = FORK.Process(target=_join_then_leave, args=(checked, registered, report, go))
    leaver.start()
    joiner.start()
    try:
        assert _finish(leaver) == 0, "the leaving daemon logged a warning or an error"
        assert registered.wait(CHILD_TIMEOUT_S), "the second daemon never registered"
        holder = Path(report.read_text())
        assert holder.is_file(), f"{holder}: the registration of a live daemon was removed"
        assert holder.parent.parent.stat().st_mode & 0o777 == 0o700
    finally:
        go.set()
        code = _finish(joiner)
    assert code == 0, "the second daemon logged a warning or an error when it left"
    assert not (own_tmpdir / f"coordinator-{os.getuid()}").exists()


def _hold_then_leave(barrier: Any) -> None:
    node_local.run_root(RUN_ID)
    caught = _quiet_or_fail()
    barrier.wait(CHILD_TIMEOUT_S)
    node_local.leave_all(keep=False)
    os._exit(1 if caught else 0)


def test_daemons_leaving_at_once_remove_the_directory_once_and_quietly(
        own_tmpdir: Path) -> None:
    """Every rank of a run on one node failing at once (a full disk) leaves at once:
    the directory goes, and no daemon meets it half-removed (finding 13:
    FileNotFoundError on .locks/cache.lock)."""
    for _ in range(ROUNDS):
        barrier = FORK.Barrier(3)
        procs = [FORK.Process(target=_hold_then_leave, args=(barrier,)) for _ in range(3)]
        for proc in procs:
            proc.start()
        codes = [_finish(proc) for proc in procs]
        assert codes == [0, 0, 0], "a daemon logged a warning or an error while leaving"
        assert not (own_tmpdir / f"coordinator-{os.getuid()}").exists()


ROUNDS = 10  # the race hit old code in most rounds on the 2-core machine


# --- Directories of runs that no daemon holds any more --------------------------------

KILLED_RUN, LIVE_RUN = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


def _hold_and_wait(run_id: str, ready: Any, size: int) -> None:
    root = node_local.run_root(run_id)
    (root / "iter-000001-abc").mkdir()
    (root / "iter-000001-abc" / "model.safetensors").write_bytes(b"\0" * size)
    ready.set()
    time.sleep(CHILD_TIMEOUT_S)  # until the test kills it
    os._exit(0)


def _adopt_and_count(report: Path) -> None:
    caught = _quiet_or_fail()
    node_local.adopt(RUN_ID)
    report.write_text("\n".join(record.getMessage() for record in caught))
    os._exit(0)


def test_a_run_whose_last_daemon_was_killed_is_named_with_its_size_and_kept(
        own_tmpdir: Path) -> None:
    """A daemon SIGKILLed as the last of its run on this node cannot remove its
    directory (whole models).  The next daemon of any run to start here names it with
    its size and what to do, and leaves it: it may be a run between a kill and its
    restart.  Directories a live daemon holds, and others that are no run's, are not
    named."""
    ready_killed, ready_live = FORK.Event(), FORK.Event()
    killed = FORK.Process(target=_hold_and_wait, args=(KILLED_RUN, ready_killed, 3 << 20))
    live = FORK.Process(target=_hold_and_wait, args=(LIVE_RUN, ready_live, 1 << 20))
    killed.start()
    live.start()
    try:
        assert ready_killed.wait(CHILD_TIMEOUT_S) and ready_live.wait(CHILD_TIMEOUT_S)
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(CHILD_TIMEOUT_S)
        base = own_tmpdir / f"coordinator-{os.getuid()}"
        (base / "notes").mkdir()  # the user's own, not a run's: no .holders
        report = own_tmpdir / "warnings"
        adopter = FORK.Process(target=_adopt_and_count, args=(report,))
        adopter.start()
        assert _finish(adopter) == 0
        (warning,) = report.read_text().splitlines()
        assert warning.startswith(
            f"this node keeps 1 directory of runs that no daemon holds, 3.0 MiB in all: "
            f"{base / KILLED_RUN} (3.0 MiB). Each was left by a daemon killed as the last of "
            "its run on this node"), warning
        assert "Remove those of finished runs (rm -rf DIR)" in warning
        assert (base / KILLED_RUN / "iter-000001-abc" / "model.safetensors").is_file()
        # Once the other run's daemon is gone too, both are named; nothing is removed.
        live.kill()
        live.join(CHILD_TIMEOUT_S)
        root = node_local.run_root(RUN_ID)
        assert [(p.name, size) for p, size in node_local.unheld_runs(root)] == [
            (KILLED_RUN, 3 << 20), (LIVE_RUN, 1 << 20)]
        assert (base / LIVE_RUN).is_dir() and (base / KILLED_RUN).is_dir()
    finally:
        for proc in (killed, live):
            if proc.is_alive():
                proc.kill()
                proc.join()
