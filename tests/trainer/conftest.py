"""Each trainer test keeps its publisher's files to itself.

A publication keeps the files it published in `<TMPDIR>/last-published/` for the
next one's delta (trainer/publisher.py); in a run TMPDIR is the run's node-local
`.tmp/`, one publisher's.  Tests of the trainer publish from the suite's process
(`train_iteration`) and from trainer processes it starts, which inherit its
environment: with the suite's TMPDIR, two tests on two xdist workers would share
one such directory, and one could remove the other's between its rename and its
record.  Every test's child processes get a TMPDIR of the test's own
(tests/conftest.py); here it is made the suite's process's too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def own_tmpdir(own_tmpdir_for_children: Path, monkeypatch: pytest.MonkeyPatch,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's own TMPDIR (tests/conftest.py: its child processes') made this
    process's gettempdir() too, for the publications made in the suite's process."""
    # pytest finds its own base directory under gettempdir() the first time a test
    # asks for one (in one process; xdist's workers are given theirs): find it now,
    # or it would lie in this test's directory, removed before the next test's tmp_path.
    tmp_path_factory.getbasetemp()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmpdir_for_children))
    return own_tmpdir_for_children
