"""coordination.on_failure "wait": a killed daemon restarted alone, the group re-forms.

One scripted run of 3 daemons and 6 iterations; in each iteration one daemon
is SIGKILLed inside a 1.5 s action (a worker at phases 1, 4, 10 and 12, the
master at phases 1 and 10) and restarted with its original command after a
delay (shorter than the lease, so the group sees a new incarnation, or longer,
so it first sees a lost rank).  No other command is typed; no survivor exits.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from coordinator.records.phases import Phase
from tests.support.cluster import LocalCluster, scripted_log, scripted_runs, write_config

pytestmark = pytest.mark.slow
LEASE = 3.0
# (iteration, victim, phase, restart delay): one kill per iteration.
KILLS = [(0, 2, 1, 1.0), (1, 1, 4, LEASE + 1.5), (2, 2, 10, 1.0), (3, 1, 12, LEASE + 1.5),
         (4, 0, 1, 1.0), (5, 0, 10, LEASE + 1.5)]
ITERATIONS = 6
# From the restart: python and imports (~1.5 s loaded), the claim taken over
# from a dead pid at once, one heartbeat seen advancing by each side.
RESUME_BOUND_S = LEASE + 5


def recoveries(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "recoveries.json").read_text())["recoveries"]  # type: ignore[no-any-return]
    except (FileNotFoundError, ValueError):
        return []


def test_killed_daemons_restarted_alone_rejoin_and_the_run_completes(tmp_path: Path) -> None:
    sleeps = ", ".join(f'"{victim}:{it}:{phase}:1.5"' for it, victim, phase, _ in KILLS)
    config = write_config(tmp_path / "c.toml", iterations=ITERATIONS, lease=LEASE,
                          scripted=f"sleeps = [{sleeps}]", on_failure="wait")
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=3, config=config)
    resumed: list[float] = []
    killed_at: list[float] = []
    try:
        c.start_all()
        for n, (it, victim, phase, delay) in enumerate(KILLS, start=1):
            c.wait_until(lambda it=it, v=victim, p=phase: c.at_phase(v, it, p, "running"), 120,
                         f"rank {victim} in iteration {it} phase {phase}")
            killed_at.append(time.time())
            c.kill(victim)
            survivors = {r: c.procs[r] for r in range(3) if r != victim}
            time.sleep(delay)
            c.start(victim)
            restarted = time.monotonic()
            c.wait_until(lambda n=n: len(recoveries(c.run_dir)) >= n, RESUME_BOUND_S + 30,
                         f"recovery {n} recorded")
            resumed.append(time.monotonic() - restarted)
            for rank, proc in survivors.items():
                assert proc.poll() is None, f"survivor {rank} exited:\n{c.output(rank)[-2000:]}"
        codes = c.wait_all(timeout=120)
        assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
    finally:
        c.close()
    assert max(resumed) <= RESUME_BOUND_S, resumed

    history = recoveries(c.run_dir)
    assert [(h["number"], h["iteration"], h["phase"], h["resume_iteration"])
            for h in history] == [(n, it, p, it) for n, (it, _, p, _) in enumerate(KILLS, 1)]
    for h, (_, victim, phase, _) in zip(history, KILLS, strict=True):
        assert h["rank"] == victim, h
        assert h["members"].keys() == {"0", "1", "2"}
        assert int(phase) in h["pending"][str(victim)], h  # the killed action runs again
        assert 0 <= h["resumed_after_s"] < 120
    # A restarted master dates the failure by its predecessor's last heartbeat (before
    # the kill): the outage it records spans the restart's delay.  Counted from a
    # regrouping worker's latest beat, as it was, it came out under a beat (0.5 s).
    for h, (_, victim, _, delay), killed in zip(history, KILLS, killed_at, strict=True):
        if victim == 0:
            assert h["detected_at"] <= killed, (h, killed)
            assert h["resumed_after_s"] >= delay, (h, delay)
    # The timeline's table says which iterations count only the work after a recovery
    # (a rank publishes its timings once it completes the iteration).
    from coordinator.ops.timeline import load, write

    write(load(c.run_dir), tmp_path / "timeline.html")
    page = (tmp_path / "timeline.html").read_text()
    for n, (it, *_) in enumerate(KILLS, start=1):
        assert f"<td>{it} (resumed by recovery {n}: only the work after it is counted)</td>" \
            in page

    # Nothing that completed was redone, but the killed action and, when a rank
    # died in training (a collective step), the survivors' training with it.
    redo = {(it, 10, r) for it, victim, phase, _ in KILLS if phase == 10
            for r in range(3) if r != victim}
    runs = scripted_runs(c.run_dir)
    assert {k for k, n in runs.items() if n != 1} == redo
    assert all(runs[k] == 2 for k in redo)
    for rank in range(3):
        expected = [(it, int(p)) for it in range(ITERATIONS) for p in Phase]
        for it, _, _, _ in sorted(KILLS, reverse=True):
            if (it, 10, rank) in redo:
                expected.insert(expected.index((it, 11)), (it, 10))
        assert scripted_log(c.run_dir, rank) == expected
