"""One pass over the source: copy, hash and check together (coordinator/storage/verified.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

import coordinator.storage.verified
from coordinator.errors import IntegrityError
from coordinator.storage.verified import copy_hashed, copy_verified, in_parallel


def test_a_copy_of_many_blocks_is_hashed_as_read_and_synced(tmp_path: Path) -> None:
    data = os.urandom(19 << 20)  # 4 full 4 MiB blocks and a short one
    (tmp_path / "src").write_bytes(data)
    assert copy_hashed(tmp_path / "src", tmp_path / "dst") == (
        len(data), hashlib.sha256(data).hexdigest())
    assert (tmp_path / "dst").read_bytes() == data
    with pytest.raises(FileExistsError):  # a new file only, never over another
        copy_hashed(tmp_path / "src", tmp_path / "dst")


def test_a_source_longer_than_its_manifest_stops_the_copy_past_the_size(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"x" * (12 << 20))
    copied, _ = copy_hashed(tmp_path / "src", tmp_path / "dst", limit=100)
    assert 100 < copied <= 4 << 20  # one block past the limit, not the whole file
    with pytest.raises(IntegrityError, match=r"copied \d+ bytes .* its manifest says 100 bytes"):
        copy_verified(tmp_path / "src", tmp_path / "again", size=100, sha256="0" * 64)


def test_a_read_error_mid_copy_is_raised_and_the_reader_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "src").write_bytes(b"y" * (40 << 20))
    real_read, reads = os.read, []

    def failing_read(fd: int, n: int) -> bytes:
        reads.append(n)
        if len(reads) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real_read(fd, n)

    monkeypatch.setattr(coordinator.storage.verified.os, "read", failing_read)
    before = threading.active_count()
    with pytest.raises(OSError, match="Input/output error"):
        copy_hashed(tmp_path / "src", tmp_path / "dst")
    assert threading.active_count() == before  # the reader thread was joined


def test_every_call_runs_at_once_and_the_first_failure_is_raised_after_all_end() -> None:
    both = threading.Barrier(2, timeout=10)  # two calls in turn would wait forever
    ended: list[str] = []

    def meet(name: str) -> str:
        both.wait()
        ended.append(name)
        return name.upper()

    assert in_parallel({"a": lambda: meet("a"), "b": lambda: meet("b")}) == {"a": "A", "b": "B"}

    def fail() -> str:
        raise ValueError("a failed")

    def slow() -> str:
        time.sleep(0.3)
        ended.append("slow")
        return "done"

    with pytest.raises(ValueError, match="a failed"):
        in_parallel({"a": fail, "b": slow}, threads=2)
    assert ended[-1] == "slow"  # raised only once the other call had ended


def test_a_source_that_stops_answering_fails_the_copy_naming_it_and_never_hangs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hard NFS mount whose server is gone: the read blocks until it is back.  The
    copy fails once no block came for STALL_S (300 s; 0.3 s here), naming the file."""
    (tmp_path / "src").write_bytes(b"z" * (12 << 20))
    real_read, reads, gone = os.read, [], threading.Event()

    def stalling_read(fd: int, n: int) -> bytes:
        reads.append(n)
        if len(reads) == 2:
            gone.wait(30)  # the server is gone, until the test ends
        return real_read(fd, n)

    monkeypatch.setattr(coordinator.storage.verified, "STALL_S", 0.3)
    monkeypatch.setattr(coordinator.storage.verified, "_READER_EXIT_S", 0.3)
    monkeypatch.setattr(coordinator.storage.verified.os, "read", stalling_read)
    started = time.monotonic()
    try:
        with pytest.raises(OSError, match=r"no data from the shared filesystem for 0.3 s "
                           r"after 4194304 bytes: is its server gone\?") as stalled:
            copy_hashed(tmp_path / "src", tmp_path / "dst")
        assert stalled.value.errno == errno.ETIMEDOUT
        assert stalled.value.filename == str(tmp_path / "src")
        assert time.monotonic() - started < 10
    finally:
        gone.set()
