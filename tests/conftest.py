from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator import fsio


@pytest.fixture
def quick_read_retry() -> Iterator[float]:
    """Reads of shared files in this process give up on a torn or damaged file
    after 1 s instead of the default 5 s: for tests of what happens once they
    give up.  A torn file repaired within the deadline is still read whole
    (tests/trainer/test_checkpoint.py repairs one after 0.3 s)."""
    before = fsio.read_retry(None)
    fsio.set_read_retry(1.0)
    yield 1.0
    fsio.set_read_retry(before)
