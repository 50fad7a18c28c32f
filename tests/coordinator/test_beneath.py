"""The file layer under every read and write of the run directory.

Both ways of resolving a path beneath the run directory (openat2, and the
component walk used where openat2 is missing) refuse a symlink anywhere on
the way; reads refuse what is not a regular file and stop at their cap;
directories get 0755 whatever the umask; rm -r never follows a symlink; a
torn read is retried, asking the server afresh, and reported with its path
once the deadline passes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.errors import IntegrityError, UnsafeFileError
from coordinator.storage import beneath, fsio
from coordinator.storage.store import read_retrying
from coordinator.storage.verified import read_verified


@pytest.fixture(params=["openat2", "walk"])
def confined(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s")
    beneath.use_openat2(request.param == "openat2")
    beneath.confine(run)
    try:
        yield run
    finally:
        beneath.release(run)
        beneath.use_openat2(None)


def test_a_symlink_anywhere_on_the_path_is_refused_for_reads_writes_and_deletes(
    confined: Path,
) -> None:
    outside = confined.parent / "outside"
    (confined / "ranks").mkdir()
    (confined / "ranks" / "1").symlink_to(outside)
    (confined / "link.json").symlink_to(outside / "secret")
    for path in (confined / "ranks/1/secret", confined / "link.json"):
        with pytest.raises(UnsafeFileError, match="is a symlink"):
            fsio.read_bytes(path)
    with pytest.raises(UnsafeFileError, match="ranks/1 is a symlink"):
        fsio.publish_bytes(confined / "ranks/1/heartbeat.json", b"{}")
    with pytest.raises(UnsafeFileError, match="ranks/1 is a symlink"):
        fsio.remove(confined / "ranks/1/secret")
    with pytest.raises(UnsafeFileError, match="ranks/1 is a symlink"):
        fsio.ensure_dir(confined / "ranks/1/logs")
    # Replacing a symlink by rename replaces the link, never its target.
    fsio.publish_bytes(confined / "link.json", b"mine")
    assert not (confined / "link.json").is_symlink()
    assert (outside / "secret").read_text() == "s"
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]


def test_rm_r_removes_a_symlink_itself_and_never_what_it_points_to(confined: Path) -> None:
    outside = confined.parent / "outside"
    (confined / "it" / "sub").mkdir(parents=True)
    (confined / "it" / "sub" / "f").write_text("x")
    (confined / "it" / "escape").symlink_to(outside)
    (confined / "top").symlink_to(outside)
    assert fsio.remove_tree(confined / "it")
    assert fsio.remove_tree(confined / "top")
    assert not (confined / "it").exists() and not os.path.lexists(confined / "top")
    assert (outside / "secret").read_text() == "s"


def test_directories_are_0755_and_files_0644_whatever_the_umask(confined: Path) -> None:
    old = os.umask(0)
    try:
        fsio.publish_bytes(confined / "a/b/c/record.json", b"{}")
    finally:
        os.umask(old)
    for path in (confined / "a", confined / "a/b", confined / "a/b/c"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    # Files get exactly 0644 once the umask takes no bits from it (the CLI sets 022).
    assert stat.S_IMODE((confined / "a/b/c/record.json").stat().st_mode) & 0o022 == 0


def test_reads_refuse_fifos_directories_and_files_over_their_cap(confined: Path) -> None:
    os.mkfifo(confined / "fifo")
    (confined / "dir").mkdir()
    (confined / "big").write_bytes(b"x" * 2000)
    with pytest.raises(UnsafeFileError, match="is a FIFO, not a regular file"):
        fsio.read_bytes(confined / "fifo")
    with pytest.raises(UnsafeFileError, match="is a directory"):
        fsio.read_bytes(confined / "dir")
    with pytest.raises(UnsafeFileError, match="is 2000 bytes, over the 1000-byte limit"):
        fsio.read_bytes(confined / "big", max_bytes=1000)
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        fsio.open_append(confined / "fifo")


def test_a_path_that_climbs_out_with_dotdot_is_refused(confined: Path) -> None:
    with pytest.raises(UnsafeFileError, match=r"contains '\.\.'"):
        fsio.read_bytes(confined / ".." / "outside" / "secret")


def test_a_relative_path_from_a_record_must_stay_inside() -> None:
    where = Path("/run/iterations/000001/phase-11/release.json")
    assert str(beneath.relative_inside("checkpoints/iter-000001", what="x", where=where)) == \
        "checkpoints/iter-000001"
    for bad in ("/etc", "../x", "a/../../x", "", "a\\b", "./a", 7, None):
        with pytest.raises(UnsafeFileError, match=r"release\.json"):
            beneath.relative_inside(bad, what="payload checkpoint", where=where)


def test_a_torn_read_is_retried_afresh_then_reported_with_its_path() -> None:
    full = b'{"schema": "x", "counter": 12}'
    calls: list[bool] = []

    def torn_then_full(fresh: bool) -> bytes:
        calls.append(fresh)
        return full if len(calls) >= 3 else full[:9]

    def parse(data: bytes, path: Path) -> int:
        import json

        return int(json.loads(data)["counter"])

    slept: list[float] = []
    assert read_retrying(torn_then_full, parse, Path("/run/x.json"), retry_s=5.0,
                         sleep=slept.append) == 12
    assert calls == [False, True, True]  # every retry asks the server afresh
    with pytest.raises(ValueError, match="Expecting"):
        read_retrying(lambda fresh: full[:9], parse, Path("/run/x.json"), retry_s=0.05,
                      sleep=lambda s: None)


def test_a_fifo_where_a_record_belongs_is_named_at_once_not_retried(tmp_path: Path) -> None:
    """A worker started on a run directory with a FIFO as run.json named it after
    two rounds of read_retry_s (10 s): no writer ever renames a FIFO into place,
    so asking again cannot change it."""
    os.mkfifo(tmp_path / "run.json")
    reads: list[bool] = []
    slept: list[float] = []

    def read(fresh: bool) -> bytes:
        reads.append(fresh)
        return fsio.read_bytes(tmp_path / "run.json", fresh=fresh)

    with pytest.raises(UnsafeFileError, match=r"run\.json: is a FIFO, not a regular file"):
        read_retrying(read, lambda data, path: data, tmp_path / "run.json", retry_s=5.0,
                      sleep=slept.append)
    assert reads == [False] and slept == []


def test_a_binary_file_is_loaded_only_as_its_manifest_lists_it(tmp_path: Path) -> None:
    data = os.urandom(5000)
    path = tmp_path / "chunk-000000.pt"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    with read_verified(path, size=5000, sha256=sha) as file:
        assert file.mapped  # a local filesystem maps: zero-copy loading
    with read_verified(path, size=5000, sha256=sha, allow_map=False) as file:
        assert file.data == data
    with pytest.raises(IntegrityError, match="is 5000 bytes, its manifest says 4999"):
        read_verified(path, size=4999, sha256=sha, retry_s=0.05)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(IntegrityError, match=r"SHA-256 .* differs from its manifest's"):
        read_verified(path, size=5000, sha256=sha, retry_s=0.05)


def test_an_io_error_is_reported_as_one_never_as_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.storage import verified

    data = b"payload" * 100
    path = tmp_path / "f"
    path.write_bytes(data)

    def eio(fd: int, n: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(verified.os, "read", eio)
    with pytest.raises(OSError) as info:
        read_verified(path, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      allow_map=False, retry_s=0.1)
    assert not isinstance(info.value, IntegrityError)
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
