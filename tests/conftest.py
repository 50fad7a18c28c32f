from __future__ import annotations

import getpass
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  (loaded before OMP_NUM_THREADS is set below: this process keeps torch's own thread count)

from coordinator.storage import fsio

# The processes the tests start (daemons, engines, trainers: often 6-9 at once on this
# machine's 2 cores) use one OpenMP thread each, as the trainer's processes do in a run
# (rl/trainer_host.py).  With torch's default, a thread per core in each, they contend:
# a 3-node RL test took 10-15 % longer and 15 % more CPU (test_rl_agent's multi-turn
# test, twice each way: 47.9 and 46.3 s against 41.9 and 42.9 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's compile cache, where torch puts it on this machine, fixed for the session:
# torch takes it from gettempdir() at its first compile and writes it into
# os.environ, and a trainer test's gettempdir() is that test's own directory
# (tests/trainer/conftest.py), removed after it; later compiles, and every process
# started after, then made that directory again (left in /tmp once the suite ended).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model with a manifest, random weights (no warm start: fast)."""
    from trainer.warmstart import build_initial_model as init_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    init_model(out, seed=0, warmstart_steps=0)
    return out


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model: warm-started, so rewards vary and training moves the weights."""
    from trainer.config import WARMSTART_STEPS
    from trainer.warmstart import build_initial_model as init_model

    out = tmp_path_factory.mktemp("model") / "warm"
    init_model(out, seed=0, warmstart_steps=WARMSTART_STEPS)
    return out


@pytest.fixture(scope="session")
def warm_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-architecture model of the tiny size (trainer/architectures.py: byte-level
    BPE, ChatML template, bf16), warm-started through its chat template as
    `coordinator init-model --arch qwen2 --size tiny` builds it."""
    from trainer.architectures import WARMSTART_STEPS_BY_SIZE, Size, preset
    from trainer.warmstart import build_initial_model as init_model

    out = tmp_path_factory.mktemp("model") / "qwen2"
    init_model(out, seed=0, warmstart_steps=WARMSTART_STEPS_BY_SIZE[Size.TINY],
               spec=preset("qwen2", "tiny"))
    return out


@pytest.fixture(autouse=True)
def own_tmpdir_for_children() -> Iterator[Path]:
    """Each test's child processes (daemons, engines, trainers) get a TMPDIR of that
    test's own, removed after it, as a Slurm job's is at its end.

    A daemon keeps the run's node-local directory under TMPDIR
    (`coordinator-<uid>/<run id>/`, rl/node_local.py); one killed with SIGKILL, as many
    tests do, leaves it behind by design, and the next daemon on that TMPDIR names it
    in a WARNING.  With the machine's /tmp shared by the whole suite, one CI run left 91
    such directories (15 MB) there, and a test that requires a clean finish to say
    nothing at WARNING failed on another test's leftovers.

    This process's own temporary directory (pytest's tmp_path, in-process code) stays
    the machine's; tests that need both on one directory set it themselves
    (tests/trainer/conftest.py).  Short, under /tmp: vLLM binds Unix sockets beneath it.
    No test may leave the suite's process another TMPDIR, since every subprocess a later
    test starts would inherit it (rl/node_local.py changes it only in a daemon's own
    process)."""
    import shutil

    before = os.environ.get("TMPDIR"), tempfile.gettempdir()
    own = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))
    os.environ["TMPDIR"] = str(own)
    try:
        yield own
        after = os.environ.get("TMPDIR"), tempfile.gettempdir()
        assert after == (str(own), before[1]), (
            f"this test changed the process's TMPDIR: {(str(own), before[1])} -> {after}")
    finally:
        if before[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[0]
        shutil.rmtree(own, ignore_errors=True)


# Module scope, not session: a server must not outlive the modules that use it
# (other tests assert that this process has no child left).
@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Azurite (Azure Blob), started once per module: tests/support/buckets.py.
    Each test takes a fresh prefix of its container (Server.bucket)."""
    from tests.support.buckets import running

    with running("azurite", tmp_path_factory.mktemp("azurite")) as started:
        yield started


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """moto's S3 server, started once per module."""
    from tests.support.buckets import running

    with running("moto", tmp_path_factory.mktemp("moto")) as started:
        yield started


@pytest.fixture(params=["azurite", "moto"])
def server(request: pytest.FixtureRequest) -> Any:
    """Each real object-store server in turn: the test runs once on each."""
    return request.getfixturevalue(request.param)
