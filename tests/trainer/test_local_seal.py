"""A node's own copies are sealed for the boot that wrote them, not fsynced
(coordinator/storage/local_seal.py): trusted until the machine restarts, made
again after; fsynced and trusted across restarts where the kernel names no boot."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.storage import local_seal
from tests.trainer.test_delta import publish, step, weights
from trainer.local_copy import copy_to_local_cache

pytestmark = pytest.mark.usefixtures("quick_read_retry")


def boot(monkeypatch: pytest.MonkeyPatch, boot_id: str | None) -> None:
    """This machine as if it had booted with `boot_id` (None: a kernel naming none)."""
    monkeypatch.setattr(local_seal, "boot_id", lambda: boot_id)


def fsynced_files(monkeypatch: pytest.MonkeyPatch, under: Path) -> list[str]:
    """The names of the regular files under `under` that os.fsync is called on, from now."""
    names: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.is_file() and under in path.parents:
            names.append(path.name)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return names


def made_at(path: Path) -> float:
    return path.stat().st_mtime


def mark_old(path: Path) -> None:
    """`path`'s times set to 1970: a file made again has now's (inode numbers are reused)."""
    os.utime(path, (0, 0))


def chain(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A full checkpoint and a delta of it on the share; the delta's tensors."""
    share, last = tmp_path / "share", tmp_path / "trainer-disk" / "last-published"
    w0 = weights()
    w1 = step(w0, 0.02, seed=1)
    publish(share, 0, w0, last)
    assert publish(share, 1, w1, last, parent=0).delta is not None
    return share, w1


def test_a_copy_is_trusted_in_its_boot_unsynced_and_made_again_after_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    boot(monkeypatch, first)
    share, _ = chain(tmp_path)
    cache = tmp_path / "node-cache"
    synced = fsynced_files(monkeypatch, cache)
    copy = copy_to_local_cache(share / "iter-000001", cache)  # the base, then the delta
    assert synced == []  # no file of either copy was fsynced: the seal names the boot
    assert (copy / local_seal.SEAL_NAME).read_text() == f"boot {first}\n"
    mark_old(copy / "model.safetensors")
    assert copy_to_local_cache(share / "iter-000001", cache) == copy
    assert made_at(copy / "model.safetensors") == 0  # trusted: used as it is
    # The machine restarts: what was not fsynced may not be on its disk; made again.
    boot(monkeypatch, second)
    again = copy_to_local_cache(share / "iter-000001", cache)
    assert again == copy and made_at(copy / "model.safetensors") > 0
    assert (copy / local_seal.SEAL_NAME).read_text() == f"boot {second}\n"


def test_where_no_boot_is_named_every_file_is_fsynced_and_trusted_across_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    boot(monkeypatch, None)
    share, _ = chain(tmp_path)
    cache = tmp_path / "node-cache"
    synced = fsynced_files(monkeypatch, cache)
    copy = copy_to_local_cache(share / "iter-000001", cache)
    # Every file of both copies (the base, then the delta applied to a clone of it).
    files = {"config.json", "manifest.json", "model.safetensors", local_seal.SEAL_NAME}
    assert set(synced) == files and synced.count("model.safetensors") >= 2
    assert (copy / local_seal.SEAL_NAME).read_text() == "durable\n"
    mark_old(copy / "model.safetensors")
    boot(monkeypatch, str(uuid.uuid4()))  # a kernel that names its boot, after a restart
    assert copy_to_local_cache(share / "iter-000001", cache) == copy
    assert made_at(copy / "model.safetensors") == 0


@pytest.mark.parametrize("seal", [None, b"", b"boot 0\n", b"\xff\xfe", b"durable, maybe"])
def test_a_copy_without_a_seal_this_boot_trusts_is_made_again(
        tmp_path: Path, seal: bytes | None) -> None:
    share, _ = chain(tmp_path)
    cache = tmp_path / "node-cache"
    copy = copy_to_local_cache(share / "iter-000001", cache)
    mark_old(copy / "model.safetensors")
    (copy / local_seal.SEAL_NAME).unlink()  # cut short before its seal was written
    if seal is not None:
        (copy / local_seal.SEAL_NAME).write_bytes(seal)
    assert copy_to_local_cache(share / "iter-000001", cache) == copy
    assert made_at(copy / "model.safetensors") > 0
    assert local_seal.sealed(copy)


def test_the_publisher_publishes_full_after_a_restart_of_its_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The publisher's kept files (the next delta's parent) are not fsynced either: a
    delta from files that may not have reached the disk would make no node's result."""
    boot(monkeypatch, str(uuid.uuid4()))
    share, tensors = chain(tmp_path)
    last = tmp_path / "trainer-disk" / "last-published"
    boot(monkeypatch, str(uuid.uuid4()))
    with caplog.at_level(logging.INFO, logger="trainer.publisher"):
        manifest = publish(share, 2, step(tensors, 0.02, seed=2), last, parent=1)
    assert manifest.delta is None
    assert "before this machine restarted" in caplog.text
    # ... and the one after it is a delta again, of the full one.
    after = publish(share, 3, step(tensors, 0.02, seed=3), last, parent=2)
    assert after.delta is not None and after.delta.base == "iter-000002"
