"""A master that refuses its own settings at start tells the workers waiting for it
(coordinator/machine/refusal.py): bare workers exit 2 with its message instead of waiting
for the join timeout, and an earlier refusal, since fixed, stops nobody.  The
worker's pure decision as a table, its reads on a store, then real daemons."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from coordinator import routing
from coordinator.errors import UsageError
from coordinator.machine.refusal import WINDOW_S, Verdict, Watch, WorkerView, clear, refuse
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import Refusal
from coordinator.storage.store import FsStore, MemoryStore, publish_record
from tests.support.cluster import LocalCluster, scripted_log, write_config

START = 1_000_000.0  # the worker process's start, on its wall clock
KEY = "run.iteratons: no such setting; did you mean run.iterations?"


def refusal(token: str, wall_time: float, message: str = "run.iteratons: no such setting",
            host: str = "gpu-01") -> Refusal:
    return Refusal(token=token, host=host, pid=42, wall_time=wall_time, message=message)


A_BIT_BEFORE = refusal("a", START - WINDOW_S + 1)  # a node that started late (Slurm)
AFTER = refusal("b", START + 3)  # all nodes at once: the master refused seconds later
EARLIER = refusal("c", START - 12 * 60)  # a previous attempt, since fixed (or not)
NEW = refusal("d", START - 12 * 60)  # another refusal, whatever its clock says
FIRST_NONE = WorkerView(first=None)
FIRST_C = WorkerView(first="c")


@pytest.mark.parametrize(("view", "seen", "expected"), [
    # The first look.
    (None, None, (FIRST_NONE, Verdict.WAIT)),
    (None, AFTER, (WorkerView(first="b"), Verdict.REFUSED)),
    (None, A_BIT_BEFORE, (WorkerView(first="a"), Verdict.REFUSED)),
    (None, refusal("x", START - WINDOW_S), (WorkerView(first="x"), Verdict.REFUSED)),
    (None, refusal("y", START - WINDOW_S - 1), (WorkerView(first="y"), Verdict.EARLIER)),
    (None, EARLIER, (FIRST_C, Verdict.EARLIER)),
    # Later looks: a refusal that appeared since (a new token) is this launch's,
    # whatever its wall time; the one seen at first stops nobody.
    (FIRST_NONE, None, (FIRST_NONE, Verdict.WAIT)),
    (FIRST_NONE, AFTER, (FIRST_NONE, Verdict.REFUSED)),
    (FIRST_NONE, NEW, (FIRST_NONE, Verdict.REFUSED)),
    (FIRST_C, EARLIER, (FIRST_C, Verdict.EARLIER)),
    (FIRST_C, NEW, (FIRST_C, Verdict.REFUSED)),
    # Removed: a master started with its settings accepted.
    (FIRST_C, None, (FIRST_C, Verdict.WAIT)),
])
def test_a_worker_exits_only_on_a_refusal_of_this_launch(view, seen, expected) -> None:
    assert WorkerView.judge(view, seen, started=START) == expected


def test_an_earlier_refusal_is_in_the_progress_line_and_a_new_one_stops_the_worker() -> None:
    store = MemoryStore()
    watch = Watch(store=store, started=START, wall=lambda: START + 5)
    watch.check()
    assert watch.note() == ""
    publish_record(store, layout.MASTER_REFUSAL, EARLIER)
    watch = Watch(store=store, started=START, wall=lambda: START + 5)
    watch.check()
    watch.check()
    assert watch.note() == ("; the master's last start, 12 min ago on gpu-01, was refused: "
                            "run.iteratons: no such setting")
    # Hostile text from the run directory is printed bounded, on one line.
    publish_record(store, layout.MASTER_REFUSAL, refusal(
        "e", START, message="train.lrr\x1b[2J: no such setting\n" + "x" * 3000, host="gpu-02"))
    with pytest.raises(UsageError) as refused:
        watch.check()
    text = str(refused.value)
    assert text.startswith("the master (pid 42 on gpu-02) refused its settings 5 s ago, so "
                           "this run cannot start: train.lrr?[2J: no such setting x"), text
    assert "\x1b" not in text and "\n" not in text and len(text) < 1300


def test_a_malformed_refusal_is_ignored_with_a_warning_naming_it(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.machine.refusal")
    store = MemoryStore()
    forged = {**EARLIER.to_json(), "pid": "42"}
    store.publish(layout.MASTER_REFUSAL, json.dumps(forged).encode())
    watch = Watch(store=store, started=START, wall=lambda: START, retry_s=0.0)
    watch.check()
    watch.check()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "master-refusal.json" in warnings[0], warnings
    assert watch.view is None and watch.note() == ""  # no look was taken
    # Once readable, it is judged like any (here: published after this worker started).
    publish_record(store, layout.MASTER_REFUSAL, AFTER)
    with pytest.raises(UsageError, match="pid 42 on gpu-01"):
        watch.check()


def test_a_refusal_goes_through_a_bucket_from_the_master_to_a_worker(moto, tmp_path) -> None:
    """Two node-local roots stand for the master's node and a worker's (S3, moto)."""
    bucket = moto.bucket("refusal")
    roots = {name: tmp_path / name for name in ("master", "worker")}
    for root in roots.values():
        root.mkdir()
        routing.mount(root, bucket.store, label=bucket.url)
    try:
        watch = Watch(store=FsStore(roots["worker"]), started=time.time())
        watch.check()
        refuse(roots["master"], KEY)
        with pytest.raises(UsageError, match=re.escape(KEY)):
            watch.check()
        assert bucket.store.read(layout.MASTER_REFUSAL) is not None
        clear(FsStore(roots["master"]), roots["master"])
        assert bucket.store.read(layout.MASTER_REFUSAL) is None
        watch.check()  # removed: the usual wait
    finally:
        for root in roots.values():
            routing.unmount(root)


# Three interpreters importing at once on a loaded 2-core box take a few seconds;
# a worker sees the refusal at its first look or within one poll (1 s) after it.
# Without it the bare workers wait for coordination.join_timeout_s, 1800 s.
REFUSED_WITHIN_S = 45.0


@pytest.mark.slow
def test_bare_workers_exit_2_with_the_masters_refusal_then_the_fixed_run_completes(
        tmp_path: Path) -> None:
    good = write_config(tmp_path / "good.toml", iterations=1)
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("iterations = 1", "iteratons = 1"))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=bad)
    try:
        started = time.monotonic()
        c.start_all()  # the workers: --worker R --run-dir P and nothing else
        codes = c.wait_all(timeout=REFUSED_WITHIN_S)
        took = time.monotonic() - started
        assert codes == {0: 2, 1: 2, 2: 2}, {r: c.output(r)[-2000:] for r in c.procs}
        assert KEY in c.output(0)
        for rank in (1, 2):
            assert "the master (pid " in c.output(rank) and KEY in c.output(rank), \
                c.output(rank)[-2000:]
        print(f"the refused master and both bare workers exited 2 in {took:.1f} s")
        assert not (c.run_dir / "run.json").exists()

        # Fixed: the master removes the refusal as it starts, then the same bare
        # workers join it (started within WINDOW_S of the refusal, they would take it
        # for this launch's if they looked before the master removed it).
        c.config = good
        c.start(0)
        c.wait_until(lambda: c.heartbeat(0) is not None, 60, "the fixed master's heartbeat")
        assert not (c.run_dir / layout.MASTER_REFUSAL).exists()
        c.start(1)
        c.start(2)
        assert c.wait_all(timeout=90) == {0: 0, 1: 0, 2: 0}, \
            {r: c.output(r)[-2000:] for r in c.procs}
    finally:
        c.close()
    for rank in range(3):
        assert scripted_log(c.run_dir, rank) == [(0, int(p)) for p in Phase]
