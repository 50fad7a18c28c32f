"""Broken settings end to end: the usage line (two nodes) with one thing broken, under
each on_failure policy.  Every node exits non-zero within a bounded time, naming the
cause; no run ever exits 0.

    max_tokens   too large for the model: refused before any engine starts (exit 2)
    data_path    a task file that does not exist: refused before the demo model is
                 built (exit 2), with the advice a changed setting needs (--new-run)
    reward       a reward that raises on every sample: the budget fails phase 1, the
                 rerun redoes the failed samples and fails again (exit 4)
    engine       an engine answering 500 to every completion (exit 4)
    agent        an agent plugin that raises in every episode (exit 4)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.integration.usage import ROOT, run_nodes
from tests.support.plugins import install_entry_points

pytestmark = pytest.mark.slow

# Short leases and a small iteration keep each run to seconds; the failure is the same.
QUICK = ("coordination.heartbeat_interval_s=0.5", "coordination.lease_s=4",
         "rollout.tasks_per_iteration=16", "rollout.eval_tasks=8")
AGENT = "tests.integration.broken_plugins:RaisingAgent"


def broken(cause: str, tmp_path: Path) -> tuple[list[str], list[str], dict[str, str], int, str]:
    """(master's extra settings, every node's, environment, exit code, words of the cause)."""
    if cause == "max_tokens":
        return ["rollout.max_tokens=1024"], [], {}, 2, "rollout.max_tokens=1024 plus the " \
            "longest prompt"
    if cause == "data_path":
        missing = tmp_path / "tasks.jsonl"
        return [f"data.path={missing}"], [], {}, 2, f"data.path '{missing}' does not exist"
    if cause == "reward":
        site = install_entry_points(tmp_path / "site", "raising-reward", {
            "coordinator.rewards": {"raising": "tests.integration.broken_plugins:raising_reward"}})
        return ["data.reward=raising"], [], {"PYTHONPATH": str(site)}, 4, \
            "the reward 'raising' raised KeyError"
    if cause.startswith("engine"):
        status = int(cause.split("-")[1])
        faults = tmp_path / "faults.json"
        faults.write_text(json.dumps({"completions": status}))
        env = json.dumps([["ROLLOUT_HF_FAULTS", str(faults)]])
        return [], [f"engine.env={env}"], {}, 4, f"HTTP {status} from"
    assert cause == "agent"
    return [], [f"rollout.agent={AGENT}"], {}, 4, "this agent always fails"


# An engine answering 400 takes the same path sooner (a 4xx is not retried:
# tests/rollout/test_client.py); 500 is the one retried first.
# Every policy with a cause that fails in a step (reward); each cause that fails in
# a step under a policy that retries, and each such policy at least once (what ends
# the retries, the repeated failure, is one rule for every cause:
# tests/coordinator/test_repeated_failure.py); max_tokens, refused in phase 0 before
# any engine starts and before any policy could act, under "wait" (which would retry);
# data_path, refused in phase 0 before the model is built, the same way.
CASES = [("max_tokens", "wait"), ("data_path", "wait"), ("reward", "exit"),
         ("reward", "shrink"), ("engine-500", "wait"), ("agent", "shrink")]


@pytest.mark.parametrize(("cause", "policy"), CASES, ids=[f"{c}-{p}" for c, p in CASES])
def test_a_broken_setting_ends_the_run_non_zero_naming_the_cause(
        tmp_path: Path, tiny_model: Path, cause: str, policy: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # The model the master would build, there already: seconds saved per case (but
    # not where the check must come before the build).
    if cause != "data_path":
        shutil.copytree(tiny_model, run / "model-init")
    master_sets, everywhere, env, code, words = broken(cause, tmp_path)
    sets = lambda items: [a for item in items for a in ("--set", item)]  # noqa: E731
    commands = [
        ["coordinator", "run", "--master", "--num-nodes", "2", "--rank-weights", "1,1",
         "--run-dir", str(run), "--iterations", "2", "--on-failure", policy,
         *sets([*QUICK, *master_sets, *everywhere])],
        ["coordinator", "run", "--worker", "1", "--run-dir", str(run), *sets(everywhere)],
    ]
    # Each attempt: engines start (about 5 s), every request fails, the group
    # regroups (a lease at most) and tries once more (coordination.max_attempts=2).
    # The plugins live in tests/: importable as an installed package's would be.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    done = run_nodes(commands, cwd=tmp_path, timeout_s=150, env=env)
    assert done.codes == {0: code, 1: code}, {r: t[-3000:] for r, t in done.logs.items()}
    for rank, log in done.logs.items():
        assert words in log, (rank, log[-3000:])
        assert "finished" not in log.splitlines()[-1]
    recoveries = run / "recoveries.json"
    if code == 2:
        # Refused in phase 0 before any engine started, and never retried.
        assert not (run / "ranks/0/logs/hf_server.log").exists()
        assert not recoveries.exists()
        for log in done.logs.values():  # the advice that works, not one that cannot
            assert "--new-run if a setting changed" in log and "coordinator recover" not in log
        if cause == "data_path":
            assert not (run / "model-init").exists()  # refused before the model was built
    elif policy == "exit":
        assert not recoveries.exists()
        assert "rank 0 stops" in done.logs[0]
    else:
        # One retry redid every failed sample, failed the same way, and stopped the run.
        assert len(json.loads(recoveries.read_text())["recoveries"]) == 1
        assert "failed the same way 2 times" in done.logs[0]
        assert "stopped for good" in done.logs[1]
