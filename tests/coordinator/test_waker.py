"""The Waker, both backends, against real renames in a real directory.

A published file (temp + rename) onto a watched name wakes; an in-place
write, a read, or a rename onto a name nobody watches does not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.storage.fsio import publish_bytes
from coordinator.storage.mounts import filesystem_type
from coordinator.storage.waker import Backend, Waker

# Events arrive within milliseconds; the generous timeout only absorbs a busy CI box.
EVENT_TIMEOUT_S = 5.0
# How long we listen to show that something does NOT wake: events that would
# come arrive well within this on an idle machine.
QUIET_S = 0.3


@pytest.fixture(params=[Backend.INOTIFY, Backend.WATCHDOG])
def waker(request: pytest.FixtureRequest) -> Iterator[Waker]:
    w = Waker(backend=request.param)
    assert w.backend == request.param, "the backend could not start on this machine"
    yield w
    w.close()


def test_a_rename_onto_a_watched_file_wakes_and_is_drained_once(tmp_path: Path,
                                                                  waker: Waker) -> None:
    target = tmp_path / "ranks" / "3" / "heartbeat.json"
    target.parent.mkdir(parents=True)
    waker.watch([target])
    publish_bytes(target, b"{}")
    assert waker.event.wait(EVENT_TIMEOUT_S), "no wake-up after a rename onto a watched file"
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    changed: set[str] = set()
    while not changed and time.monotonic() < deadline:
        changed = waker.drain()
    assert changed == {str(target)}
    assert waker.drain() == set()


def test_writes_reads_and_unwatched_names_do_not_wake(tmp_path: Path, waker: Waker) -> None:
    watched, other = tmp_path / "a.json", tmp_path / "b.json"
    watched.write_bytes(b"old")
    waker.watch([watched])
    with open(watched, "r+b") as f:  # in place: no rename
        f.write(b"new")
    watched.read_bytes()
    publish_bytes(other, b"{}")
    assert not waker.event.wait(QUIET_S)
    assert waker.drain() == set()


def test_watching_a_new_set_replaces_the_old_one(tmp_path: Path, waker: Waker) -> None:
    first, second = tmp_path / "one" / "hb.json", tmp_path / "two" / "hb.json"
    first.parent.mkdir()
    second.parent.mkdir()
    waker.watch([first])
    waker.watch([second])
    publish_bytes(first, b"{}")
    assert not waker.event.wait(QUIET_S), "a file no longer watched still woke the waiter"
    publish_bytes(second, b"{}")
    assert waker.event.wait(EVENT_TIMEOUT_S)
    assert str(second) in waker.drain()


def test_a_directory_that_appears_later_is_watched_on_the_next_watch(tmp_path: Path,
                                                                       waker: Waker) -> None:
    target = tmp_path / "not-yet" / "hb.json"
    waker.watch([target])  # must not raise: the waiter polls meanwhile
    target.parent.mkdir()
    waker.watch([target])  # the same set again: the missing directory is retried
    publish_bytes(target, b"{}")
    assert waker.event.wait(EVENT_TIMEOUT_S)
    assert str(target) in waker.drain()


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /mnt/shared rw,relatime shared:20 - nfs4 fs:/export rw,vers=4.2
41 22 0:46 / /mnt/my\\040cluster rw,nosuid - fuse.sshfs host:/x rw
42 40 0:47 / /mnt/shared/scratch rw - tmpfs tmpfs rw
43 22 0:48 / /data/états rw - lustre 10.0.0.1@tcp:/fs rw
"""


@pytest.mark.parametrize(("path", "expected"), [
    ("/mnt/shared/run", "nfs4"),
    ("/mnt/shared", "nfs4"),
    ("/mnt/sharedother/run", "ext4"),  # a prefix of the name is not a parent
    ("/mnt/my cluster/run", "fuse.sshfs"),  # octal-escaped space in the mount point
    ("/mnt/shared/scratch/run", "tmpfs"),  # the innermost mount wins
    ("/home/user/run", "ext4"),
    ("/data/états/run", "lustre"),  # non-ASCII names are not escaped
])
def test_the_filesystem_of_a_path_is_its_innermost_mount(path: str, expected: str) -> None:
    assert filesystem_type(Path(path), MOUNTINFO) == expected


def test_only_a_local_filesystem_with_every_watch_in_place_makes_events_complete(
        tmp_path: Path) -> None:
    local = Waker(backend=Backend.INOTIFY, local=True)
    remote = Waker(backend=Backend.INOTIFY, local=False)
    try:
        assert local.complete and not remote.complete
        local.watch([tmp_path / "missing" / "hb.json"])
        assert not local.complete, "an unwatched directory must bring fast polling back"
    finally:
        local.close()
        remote.close()
