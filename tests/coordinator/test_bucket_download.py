"""A large object is downloaded in ranges, each its own request under the client's
timeout, all of the version the first answer named (coordinator/storage/objstore.py
download), on each real object-store server."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from coordinator.storage import fsio, objstore


def test_a_large_object_comes_in_ranges_whole_and_a_replaced_one_is_stale(
        server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objstore, "RANGE_BYTES", 1 << 20)  # 64 MiB for real
    store = server.bucket("ranges").store
    data = os.urandom((3 << 20) + 12345)  # 3 whole ranges and a short one
    (tmp_path / "weights").write_bytes(data)
    store.upload("weights", tmp_path / "weights")
    small = b"a record"
    store.publish("small.json", small)

    before = fsio.STATS.snapshot()
    store.download("weights", tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == data
    assert (fsio.STATS.snapshot() - before)["get"] == 1 + 4  # the first answer, 4 ranges
    store.download("small.json", tmp_path / "small")
    assert (tmp_path / "small").read_bytes() == small

    # Replaced between the first answer and a range: ESTALE (a reader retries), never
    # a file of two versions.
    real_range = objstore.ObjectStore._range

    def replaced_first(self: objstore.ObjectStore, key: str, start: int, end: int,
                       etag: str) -> Any:
        if start == 0:
            (tmp_path / "weights").write_bytes(data[::-1])
            self.upload(key, tmp_path / "weights")
        return real_range(self, key, start, end, etag)

    monkeypatch.setattr(objstore.ObjectStore, "_range", replaced_first)
    with pytest.raises(OSError) as stale:
        store.download("weights", tmp_path / "torn")
    assert stale.value.errno == errno.ESTALE and "replaced while it was being read" in str(
        stale.value)
    assert not (tmp_path / "torn").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".torn.")]
