"""Phase 13's pruning on a network filesystem: a checkpoint with a file still open on
the master's node cannot be removed yet (NFS renames the removed open file to
.nfsXXXX, FUSE to .fuse_hiddenXXXX, and the directory is not empty until it is
closed).  That is no failure of the phase: the directory goes at a later one."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rl.plan import _remove_unless_busy
from tests.support.netfs import NetFs

pytestmark = pytest.mark.netfs


def test_a_checkpoint_with_an_open_file_is_kept_for_a_later_prune(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with NetFs(tmp_path / "fs", mounts=1) as fs:
        old = fs.mounts[0] / "checkpoints/iter-000000"
        old.mkdir(parents=True)
        (old / "model.safetensors").write_bytes(b"\0" * 4096)
        (old / "config.json").write_text("{}")
        held = os.open(old / "model.safetensors", os.O_RDONLY)  # a trainer's mmap, say
        try:
            with caplog.at_level(logging.INFO, logger="rl.plan"):
                assert _remove_unless_busy(old) is None
            assert old.is_dir() and not (old / "config.json").exists()
            assert "still has a file in it open" in caplog.text, caplog.text
        finally:
            os.close(held)
        assert _remove_unless_busy(old) is True  # the next iteration's phase 13
        assert not old.exists()
        assert _remove_unless_busy(old) is False  # nothing left: pruned before
