"""Reward functions, registered by name.

A reward function maps (response_text, ground_truth) to a float in [0, 1];
1.0 means correct, which is what the aggregate's accuracy counts.  Reward
functions never raise on bad model output: an unparsable or pathological
response is simply wrong (0.0), because one odd sample must not fail a whole
rollout of thousands.

    exact_match  the response, stripped of surrounding whitespace, equals the
                 stripped ground truth (the built-in digit-reversal task)
    math         math-verify parses the ground truth and the response into
                 sympy and checks equivalence (gsm8k, MATH and the like)

Rewards of one's own come from installed packages, through the entry-point
group `coordinator.rewards` (a function, or a class made with no arguments),
the way run.actions finds its implementations: run.json names a reward, never
a path to code (docs/PLUGINS.md), or from a Python file each node names itself
(reward.path, verl's compute_score: rollout/reward_file.py).  A reward that
raises fails its sample, not the rollout: the sample is saved as failed and
counts against rollout.max_failed_fraction (rollout/sampling_agent.py).

Built-in sampling scores through one interface, a Scorer: (task, response) ->
Score, the reward and the other numbers a reward may report beside it (a
compute_score's dict), which the aggregation averages into the iteration's
metrics as reward/<name>.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Final

from rollout.errors import UnknownRewardError
from rollout.guarded_call import CallTimedOut, GuardedWorker
from rollout.reward_tally import count_call
from rollout.tasks import REVERSE_SOURCE, Task

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]

# The numbers a reward reports beside its score become metrics named
# reward/<name> (TensorBoard tags, JSON keys): plain names, and a few per answer.
METRIC_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_METRICS: Final = 16


def check_metrics(extra: Mapping[str, float], *, where: str) -> None:
    """ValueError unless `extra` is at most MAX_METRICS finite numbers under plain names."""
    if len(extra) > MAX_METRICS:
        raise ValueError(f"{where}: {len(extra)} numbers beside the score, more than "
                         f"{MAX_METRICS}: report at most {MAX_METRICS} (each becomes a metric)")
    for name, value in extra.items():
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            raise ValueError(f"{where}: {name!r} is not a metric name: use letters, digits, "
                             "'_', '.' or '-', at most 64")
        if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
            raise ValueError(f"{where}: {name}={value!r} is not a finite float")


@dataclass(frozen=True)
class Score:
    """One answer's reward, and the numbers the reward reported beside it (a
    compute_score's dict: reward/<name> in the iteration's metrics, averaged
    over the answers that report it)."""

    value: float
    extra: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_metrics(self.extra, where="reward metrics")


# What built-in sampling calls for each answer: (task, response text) -> Score.
Scorer = Callable[[Task, str], Score]


def text_scorer(fn: RewardFn) -> Scorer:
    """A registered reward, (response, ground truth text) -> float, as a Scorer."""

    def score(task: Task, response: str) -> Score:
        return Score(fn(response, task.ground_truth))

    return score


def exact_match(response: str, ground_truth: str) -> float:
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


# Each parse and the comparison are bounded by math-verify's own alarm in the
# worker process, and the whole call by killing that process (guarded_call.py
# says why an alarm alone is no deadline).
DEFAULT_MATH_TIMEOUT_SECONDS: Final = 5
# A call of a reward running in a worker process (the math reward, a reward
# file) with no result within this is killed and scores 0, counted: the math
# reward's two parses and comparison, and a second more.
DEFAULT_CALL_SECONDS: Final = 3 * DEFAULT_MATH_TIMEOUT_SECONDS + 1

_MATH_WORKER = GuardedWorker("rollout.rewards:math_score")


def math_score(response: str, ground_truth: str, timeout_seconds: int) -> float:
    """math-verify's verdict, computed in the process that calls it (the guarded worker)."""
    # Deferred: math-verify pulls in sympy and antlr, seconds of import time
    # that callers of exact_match should not pay.
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    on_main = threading.current_thread() is threading.main_thread()
    timeout = timeout_seconds if on_main else None
    try:
        # Boxing the reference makes math-verify read it as one LaTeX answer
        # ("1,000" stays a number, "\frac{1}{2}" stays a fraction).
        boxed = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
        gold = parse(boxed, parsing_timeout=timeout) or parse(ground_truth, parsing_timeout=timeout)
        if not gold:
            logger.warning("math reward: ground truth %r does not parse; scoring 0", ground_truth)
            return 0.0
        answer = parse(response, parsing_timeout=timeout)
        if not answer:
            return 0.0
        return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0
    except TimeoutException:  # a BaseException in math-verify, so named explicitly
        return 0.0
    except Exception:
        # Parsing untrusted model output can fail in many sympy/antlr ways;
        # all of them mean "not a correct answer".
        return 0.0


@dataclass(frozen=True, kw_only=True)
class MathVerifyReward:
    """math-verify equivalence of the response's final answer and the ground truth.

    Computed in a worker process: a call that takes longer than three times
    `timeout_seconds` (two parses and a comparison) is killed and scores 0,
    on any thread, whatever sympy is doing; each such call is counted
    (rollout/reward_tally.py: reward_timeouts in the iteration's metrics).  A
    worker that dies during a call (killed, out of memory, a crash) gives no
    score: WorkerDied is raised, and the sample fails naming it.
    """

    timeout_seconds: int = DEFAULT_MATH_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if isinstance(self.timeout_seconds, bool) or self.timeout_seconds < 1:
            raise ValueError(
                f"timeout_seconds={self.timeout_seconds!r} is below 1: signal.alarm counts "
                "whole seconds, give a positive integer"
            )

    def __call__(self, response: str, ground_truth: str) -> float:
        try:
            value = _MATH_WORKER.call(response, ground_truth, self.timeout_seconds,
                                      seconds=3 * self.timeout_seconds + 1)
        except CallTimedOut:
            count_call(timed_out=True)
            logger.info("math reward: no verdict within %ss; scoring 0",
                        3 * self.timeout_seconds + 1)
            return 0.0
        count_call(timed_out=False)
        return float(value)


_REGISTRY: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": MathVerifyReward(),
}

# data_source substrings (lower case) of the common verl math sets: gsm8k,
# lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, math_dapo, aime*, amc*,
# AI-MO/NuminaMath*, Olympiad*, DeepScaleR.
_MATH_SOURCE_MARKERS: Final = ("gsm8k", "math", "aime", "amc", "numina", "olympiad", "deepscaler")


ENTRY_POINT_GROUP: Final = "coordinator.rewards"


def reward_names() -> tuple[str, ...]:
    """Built-in and registered rewards, and those installed packages provide."""
    return tuple(sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))}))


def register_reward(name: str, fn: RewardFn, *, replace: bool = False) -> None:
    if not name:
        raise ValueError("reward name is empty: give a short identifier such as 'exact_match'")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"reward {name!r} is already registered: pick another name or pass replace=True"
        )
    _REGISTRY[name] = fn


def get_reward(name: str) -> RewardFn:
    """A registered reward, or one an installed package provides (loaded once)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = reward_names()
        raise UnknownRewardError(
            f"unknown reward {name!r}: known rewards are {', '.join(known)} (a reward of "
            f"your own: install a package that registers it in the entry-point group "
            f"{ENTRY_POINT_GROUP}, on every node)",
            name=name,
            known=known,
        )
    try:
        target = found[0].load()
        fn = target() if inspect.isclass(target) else target
    except Exception as exc:  # the package's own import or constructor failed
        raise UnknownRewardError(
            f"reward {name!r} ({found[0].value}, entry point of {ENTRY_POINT_GROUP}) cannot be "
            f"loaded: {type(exc).__name__}: {exc}; fix or reinstall its package on this node",
            name=name, known=reward_names()) from exc
    if not callable(fn):
        raise UnknownRewardError(
            f"reward {name!r} ({found[0].value}) is not callable: register a function "
            "(response, ground_truth) -> float, or a class whose instances are",
            name=name, known=reward_names())
    _REGISTRY.setdefault(name, fn)
    return _REGISTRY[name]


def default_reward_for(data_source: str) -> str:
    """The reward name for a task's data_source, or an error asking to choose one."""
    if data_source == REVERSE_SOURCE:
        return "exact_match"
    lowered = data_source.lower()
    if any(marker in lowered for marker in _MATH_SOURCE_MARKERS):
        return "math"
    known = reward_names()
    raise UnknownRewardError(
        f"data_source {data_source!r} has no default reward: name one explicitly "
        f"(known rewards: {', '.join(known)})",
        name=data_source,
        known=known,
    )
