"""A reward file that waits for the test's word before each verdict: rollouts stepped
answer by answer, so a node can be stopped at an exact point of its rollout.

A test that kills a node "mid-rollout" needs the node to have saved some of its
groups and not all of them.  Stopping the engine once a chunk is listed is a race
a loaded machine loses: the engine generates ahead, and the daemon can score and
save every remaining group between the poll that saw the first chunk and the
SIGSTOP.  Here the reward is the gate instead.  Built-in sampling scores a
group's answers one at a time, in task order, in the rollout's own thread, and
publishes a group's chunk (rollout.checkpoint_every_groups = 1) before it scores
the next group's first answer; so a call that waits while its rollout's manifest
already lists a chunk holds that rollout with exactly what it has saved.

    node (reward worker, this file's compute_score)   test (RewardGate, a thread)
    ───────────────────────────────────────────────   ──────────────────────────────
    writes <gate>/call-<id>, waits for go-<id>  ───>   hold condition true?  keep it
                                                 <───  otherwise writes go-<id>
    scores with the task's default reward

Only a node started with COORDINATOR_TEST_REWARD_GATE=<gate> waits: every node
loads the same file (phase 0 compares the file's hash across ranks), the others
score at once.  The gate directory is on the test's local disk, never on the
network filesystem under test.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "COORDINATOR_TEST_REWARD_GATE"
WAIT_S = 600.0  # a reward call's longest wait for the test: then the sample fails, loudly


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Any = None) -> float:
    """The task's default reward, once the test lets this call through."""
    from rollout.rewards import default_reward_for, get_reward

    gate = os.environ.get(ENV)
    if gate:
        _wait_for_go(Path(gate))
    return get_reward(default_reward_for(data_source))(solution_str, ground_truth)


def _wait_for_go(gate: Path) -> None:
    # A killed node's worker dies with it (PR_SET_PDEATHSIG, rollout/guarded_call.py).
    call = uuid.uuid4().hex
    (gate / f"call-{call}").touch()
    deadline = time.monotonic() + WAIT_S
    while not (gate / f"go-{call}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never let reward call {call} in {gate} through "
                               f"within {WAIT_S:.0f} s")
        time.sleep(0.005)


class RewardGate:
    """The test's side: lets every call through, except while `hold_when`'s condition
    is true for a waiting call; that call is then held (`holding`) until `go_on`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700)
        self._condition: Callable[[], bool] | None = None
        self._held: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reward-gate", daemon=True)

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes a node's reward calls wait for this gate."""
        return {ENV: str(self.directory)}

    def __enter__(self) -> RewardGate:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.go_on()
        self._stop.set()
        self._thread.join(timeout=10)

    def hold_when(self, condition: Callable[[], bool]) -> None:
        """Hold the first call that waits while `condition()` is true."""
        with self._lock:
            self._condition, self._held = condition, None

    def holding(self) -> bool:
        with self._lock:
            return self._held is not None

    def go_on(self) -> None:
        """Let the held call, and every call after it, through."""
        with self._lock:
            held, self._condition, self._held = self._held, None, None
        if held is not None:
            self._let_through(held)

    def _serve(self) -> None:
        while not self._stop.wait(0.01):
            for name in sorted(os.listdir(self.directory)):
                if not name.startswith("call-") or (self.directory / f"go-{name[5:]}").exists():
                    continue
                call = name[5:]
                with self._lock:
                    if self._held is not None:  # one call held; the rest wait with it
                        continue
                    if self._condition is not None and self._condition():
                        self._held = call
                        continue
                self._let_through(call)

    def _let_through(self, call: str) -> None:
        (self.directory / f"go-{call}").touch()
