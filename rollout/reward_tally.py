"""How many reward calls a rollout made under a time limit, and how many ran out of it.

A reward with a time limit (the math reward: rollout/rewards.py; a reward
file: rollout/reward_file.py) scores 0 when its call runs out of time, as a
wrong answer would; a run whose answers time out by the hundred would learn
from wrong rewards without a word.  So
every such call is counted, in the tally of the rollout that made it:

    roll_out_shard (rl/rollouts.py)      with tallying(RewardTally()) as tally:
      the built-in sampler, same thread      reward(...) -> count_call(timed_out=...)
      agent episode threads, started in      reward(...) -> count_call(timed_out=...)
        a copy of the caller's context
        (rollout/agents.py)
    RankCheckpointWriter                 manifest.json: reward_calls, reward_timeouts
    phase 4 / phase 6's merge            metrics/rollout.json, metrics/eval.json, and a
                                         WARNING past TIMEOUT_WARNING_FRACTION

The tally travels in a context variable, not a global: a thread that runs
on after its phase (an abandoned episode) counts into its own phase's tally,
never the next one's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Final

# More timed-out calls than this share of an iteration's calls is logged at
# WARNING: a few pathological answers are expected, a steady share means the
# limit is too tight for the machine (or the answers) and the rewards are wrong.
TIMEOUT_WARNING_FRACTION: Final = 0.01


@dataclass
class RewardTally:
    """Counts, shared by the threads of one rollout (hence the lock)."""

    calls: int = 0
    timeouts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, *, timed_out: bool) -> None:
        with self._lock:
            self.calls += 1
            self.timeouts += timed_out

    def counts(self) -> tuple[int, int]:
        """(calls, timeouts), read together while other threads count."""
        with self._lock:
            return self.calls, self.timeouts


_CURRENT: ContextVar[RewardTally | None] = ContextVar("reward_tally", default=None)


@contextlib.contextmanager
def tallying(tally: RewardTally) -> Iterator[RewardTally]:
    """Count the reward calls made in this context (and in threads started in a copy of it)."""
    token = _CURRENT.set(tally)
    try:
        yield tally
    finally:
        _CURRENT.reset(token)


def count_call(*, timed_out: bool) -> None:
    """One reward call with a time limit, in whatever rollout is counting here (if any)."""
    tally = _CURRENT.get()
    if tally is not None:
        tally.count(timed_out=timed_out)


def timeout_warning(*, calls: int, timeouts: int, iteration: int, split: str) -> str | None:
    """The WARNING line when more than TIMEOUT_WARNING_FRACTION of `calls` timed out."""
    if not calls or timeouts <= TIMEOUT_WARNING_FRACTION * calls:
        return None
    return (f"iteration {iteration}: {timeouts} of {calls} {split} reward calls "
            f"({timeouts / calls:.1%}, more than {TIMEOUT_WARNING_FRACTION:.0%}) ran out of "
            "time and scored 0 whatever the answer: the run learns from those zeros; look at "
            "the node's load, or give the reward more time (a reward file: reward.timeout_s; "
            "the math reward: a MathVerifyReward with a larger timeout_seconds, registered as "
            "a reward of your own: docs/PLUGINS.md)")
