"""Each trainer test keeps its publisher's files to itself.

A publication keeps the files it published in `<TMPDIR>/last-published/` for the
next one's delta (trainer/publisher.py); in a run TMPDIR is the run's node-local
`.tmp/`, one publisher's.  Tests of the trainer publish from the suite's process
(`train_iteration`) and from trainer processes it starts, which inherit its
environment: with the suite's TMPDIR, two tests on two xdist workers would share
one such directory, and one could remove the other's between its rename and its
record.  Here each test gets a directory of its own, short (trainer processes may
bind sockets beneath it), removed after the test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def own_tmpdir(monkeypatch: pytest.MonkeyPatch,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # pytest finds its own base directory under gettempdir() the first time a test
    # asks for one (in one process; xdist's workers are given theirs): find it now,
    # or it would lie in this test's directory, removed before the next test's tmp_path.
    tmp_path_factory.getbasetemp()
    path = Path(tempfile.mkdtemp(prefix="trainer-test-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))  # the processes a test starts
    monkeypatch.setattr(tempfile, "tempdir", str(path))  # this process's gettempdir()
    try:
        yield path
    finally:
        monkeypatch.undo()
        shutil.rmtree(path, ignore_errors=True)
