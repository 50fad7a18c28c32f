"""Chaos: 10 SIGKILLs of random ranks at random moments, each restarted after a random delay.

A scripted run of 3 daemons, each on its own sshfs mount of one export
(tests/support/netfs.py: attribute, name and listing caches like NFS
clients'), with coordination.on_failure "wait".  The seed is fixed and
printed, so a failure can be replayed.  The run must complete with nothing
hanging, and every action of every iteration must have completed on every
rank, redone only where a kill forced it: the action the killed daemon was
in, and training (a collective step) on every rank when one died in it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from coordinator.records.phases import Phase
from tests.support.cluster import LocalCluster, scripted_log, scripted_runs, write_config
from tests.support.netfs import NetFs

pytestmark = [pytest.mark.slow, pytest.mark.netfs]
SEED = 20261123
KILLS = 10
ITERATIONS = 20  # ~1 iteration passes per kill cycle: 10 kills end by iteration ~12
LEASE = 5.0  # sshfs on a loaded 2-core box: a beat can take a second
# Per kill: the lease (when the restart comes later), the restart, a rejoin
# over sshfs.  Generous: a wait that times out here is a hang.
RESUME_TIMEOUT_S = 60.0


def recoveries(run: Path) -> int:
    try:
        return len(json.loads((run / "recoveries.json").read_text())["recoveries"])
    except (FileNotFoundError, ValueError):
        return 0


def iteration_of(c: LocalCluster) -> int:
    hb = c.heartbeat(0)
    return int(hb["iteration"]) if hb else 0


def test_ten_random_kills_on_network_mounts_and_the_run_completes(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"\nchaos seed {SEED}")
    config = write_config(tmp_path / "c.toml", iterations=ITERATIONS, lease=LEASE,
                          scripted="sleep_s = 0.1", on_failure="wait")
    with NetFs(tmp_path / "fs", mounts=3) as fs:
        (fs.mounts[0] / "run").mkdir()
        c = LocalCluster(fs.mounts[0] / "run", tmp_path, num_nodes=3, config=config)
        paths = [m / "run" for m in fs.mounts]
        run = fs.export / "run"
        kills: list[tuple[int, int]] = []  # (rank, iteration of the master when killed)
        started = time.monotonic()
        try:
            for rank in range(3):
                c.start(rank, c.command(rank, run_dir=paths[rank]))
            c.wait_until(lambda: iteration_of(c) >= 1, 120, "the first iteration")
            for n in range(1, KILLS + 1):
                time.sleep(rng.uniform(0.0, 2.0))
                assert iteration_of(c) < ITERATIONS - 2, "the run outpaced the kills"
                victim = rng.randrange(3)
                kills.append((victim, iteration_of(c)))
                c.kill(victim)
                time.sleep(rng.uniform(0.2, LEASE + 2.0))
                c.start(victim, c.command(victim, run_dir=paths[victim]))
                c.wait_until(lambda n=n: recoveries(run) >= n, RESUME_TIMEOUT_S,
                             f"recovery {n} (rank {victim} killed)")
            codes = c.wait_all(timeout=240)
            assert codes == {0: 0, 1: 0, 2: 0}, {r: c.output(r)[-3000:] for r in codes}
        finally:
            c.close()
        elapsed = time.monotonic() - started
        print(f"kills (rank, iteration): {kills}; run took {elapsed:.0f} s")
        history = json.loads((run / "recoveries.json").read_text())["recoveries"]
        assert len(history) == KILLS
        assert [h["rank"] for h in history] == [v for v, _ in kills]

        # Every action of every iteration completed on every rank, in order;
        # beyond the one run, only what a kill forced: the killed daemon's
        # action in progress (at most one per kill) and collective training.
        runs = scripted_runs(run)
        every = {(it, int(p), r) for it in range(ITERATIONS) for p in Phase for r in range(3)}
        assert set(runs) == every
        extra = {k: n - 1 for k, n in runs.items() if n > 1}
        non_collective = {k: n for k, n in extra.items() if k[1] != int(Phase.TRAIN)}
        assert sum(non_collective.values()) <= KILLS, non_collective
        assert all(n <= KILLS for n in extra.values()), extra
        for rank in range(3):
            log = scripted_log(run, rank)
            assert sorted(set(log)) == [(it, int(p)) for it in range(ITERATIONS) for p in Phase]
            assert log == sorted(log), f"rank {rank} ran an action out of order"
