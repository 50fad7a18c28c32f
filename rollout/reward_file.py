"""A reward function in a Python file, the way verl users write one.

    [reward]
    path = "my_reward.py"        # node-local: each node names the code it runs
    function = "compute_score"   # compute_score(data_source, solution_str,
                                 #               ground_truth, extra_info)

The function is called with keywords, as verl calls it, with the task's
data_source, the response text, and the row's reward_model.ground_truth and
extra_info exactly as the data holds them (any JSON value).  It returns a
number, or a dict with a numeric "score" whose other numeric values (bools
included) are averaged into the iteration's metrics as reward/<name>; other
values (a predicted answer, a string) are ignored.

    daemon (any thread)                      worker: python -m rollout.guarded_call
    ───────────────────                      ──────────────────────────────────────
    FileReward.check()  phase 0, every node  load_in_worker(path, function):
                                               exec the file, find the function,
                                               bind its signature to verl's keywords
                        <── ready, or the problem (exit 2 on every node)
    FileReward.score()  each answer ───────> the function, its result normalised
                        <── {"score": s, "extra": {...}}, or the exception's text

Why the user's code runs in the guarded worker process, never in the daemon:
a deadline that always holds (rollout/guarded_call.py: an alarm is no deadline,
and a thread cannot be killed; a call still running at reward.timeout_s is
killed, scores 0 and is counted in reward_timeouts, as the math reward's is);
a crash in it (a segfault in a C extension, os._exit, memory exhausted) fails
the sample naming how the worker ended instead of taking the daemon, its
heartbeats and its engine along; and what it imports or changes (signal
handlers, stdout, threads) stays out of the daemon.  The price is a JSON line
each way per answer (tests/rollout/test_reward_file.py measures it).

The worker loads the file when it starts and keeps it; a new worker (after a
timeout or a death) loads the file again.  Its identity (the function and the
file's SHA-256) is what phase 0 compares across the ranks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import numbers
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rollout.errors import RewardFileError
from rollout.guarded_call import CallTimedOut, GuardedCallError, GuardedWorker, StartFailed
from rollout.reward_tally import count_call
from rollout.rewards import DEFAULT_CALL_SECONDS, Score, check_metrics
from rollout.tasks import Task

logger = logging.getLogger(__name__)

DEFAULT_FUNCTION: Final = "compute_score"
# verl's names, passed as keywords: a function written for verl runs unchanged,
# whatever order its parameters are in.
PARAMETERS: Final = ("data_source", "solution_str", "ground_truth", "extra_info")
_CALL: Final = f"({', '.join(PARAMETERS)})"


@dataclass(frozen=True, kw_only=True)
class FileReward:
    """reward.path's function, called in this process's worker for that file."""

    path: str
    function: str = DEFAULT_FUNCTION
    timeout_s: float = DEFAULT_CALL_SECONDS

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("reward.path is empty: give the Python file defining the reward")
        if not self.function.isidentifier():
            raise ValueError(f"reward.function={self.function!r} is not a Python name: give "
                             f"the function's name, e.g. {DEFAULT_FUNCTION}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s!r} must be a positive number "
                             "of seconds")

    @property
    def name(self) -> str:
        """How samples and logs name this reward."""
        return f"{self.path}:{self.function}"

    def identity(self) -> str:
        """The function and the file's content, as phase 0 compares them across ranks
        (each node names its own path; the same file may lie at different paths)."""
        return f"{self.function} in a file of SHA-256 {_sha256(self.resolved())}"

    def resolved(self) -> Path:
        """The file itself: the path is the user's own, a symlink in it is followed."""
        return Path(os.path.realpath(self.path))

    def check(self) -> str:
        """Start this file's worker here: the file exists, loads, and defines the
        function with a signature verl's call binds to.  Returns identity();
        RewardFileError naming the problem and the fix otherwise."""
        file = self.resolved()
        if not file.is_file():
            raise RewardFileError(
                f"reward.path {self.path!r} is not a file here (resolved: {file}): give the "
                "Python file defining the reward, on every node", path=self.path)
        try:
            _worker(self).start()
        except StartFailed as exc:
            reason = exc.reason.removeprefix(f"{RewardFileError.__name__}: ")
            raise RewardFileError(f"reward.path {self.path!r}: {reason}",
                                  path=self.path) from None
        return self.identity()

    def score(self, task: Task, response: str) -> Score:
        """The function's verdict on `response`.  A call with no result within
        timeout_s scores 0 and is counted (reward_timeouts); an exception in the
        function, a malformed result or a worker that dies raise, and the sample
        fails naming it."""
        try:
            reply = _worker(self).call(task.data_source, response, task.truth, task.extra_info,
                                       seconds=self.timeout_s)
        except CallTimedOut:
            count_call(timed_out=True)
            logger.info("reward %s: no verdict within %gs for task %s; scoring 0", self.name,
                        self.timeout_s, task.task_id)
            return Score(0.0)
        except GuardedCallError:
            count_call(timed_out=False)  # a call that ended without a score: its sample fails
            raise
        count_call(timed_out=False)
        return _score_of(reply)


_WORKERS: dict[tuple[str, str], GuardedWorker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(reward: FileReward) -> GuardedWorker:
    """One worker per file and function in this process, made on first use."""
    key = (str(reward.resolved()), reward.function)
    with _WORKERS_LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = GuardedWorker(f"{__name__}:load_in_worker", init_args=key,
                                          label=f"reward {reward.name}")
        return _WORKERS[key]


def close_workers() -> None:
    """Stop every reward-file worker of this process (each also ends with it)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.close()


def _sha256(file: Path) -> str:
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise RewardFileError(f"reward.path {file} cannot be read: {exc}",
                              path=str(file)) from exc


def _score_of(reply: Any) -> Score:
    """The worker's reply as a Score; the worker ran the user's code, so it is checked."""
    if not isinstance(reply, dict) or isinstance(reply.get("score"), bool) \
            or not isinstance(reply.get("score"), int | float) \
            or not isinstance(reply.get("extra"), dict):
        raise ValueError(f"the reward worker replied {reply!r:.200}, not a score")
    return Score(float(reply["score"]), {str(k): v for k, v in reply["extra"].items()})


# --- in the worker process ---------------------------------------------------------


def load_in_worker(path: str, function: str) -> Callable[..., dict[str, Any]]:
    """The worker's factory (rollout/guarded_call.py): the file's function, checked,
    wrapped to be called with verl's keywords and to give a JSON reply."""
    fn = _function(_load(path), path, function)
    return lambda data_source, solution_str, ground_truth, extra_info: _normalise(
        fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
           extra_info=extra_info), function)


def _load(path: str) -> Any:
    # Registered under its own name before it runs, as an import would be: a
    # dataclass or pickle in the file looks its module up in sys.modules.
    name = "coordinator_reward_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardFileError(f"{path} cannot be loaded as Python: give a .py file",
                              path=path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardFileError(
            f"running the file raised {type(exc).__name__}: {exc}; fix the file (it is run "
            "once per worker, as an import is)", path=path) from exc
    return module


def _function(module: Any, path: str, function: str) -> Callable[..., Any]:
    fn = getattr(module, function, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and inspect.isfunction(v)
                       and v.__module__ == module.__name__)
        raise RewardFileError(
            f"it defines no {function!r} (its functions: {', '.join(found) or 'none'}): "
            f"name one with reward.function, or define def {function}{_CALL}",
            path=path)
    if not callable(fn):
        raise RewardFileError(f"{function} is a {type(fn).__name__}, not a function: define "
                              f"def {function}{_CALL}", path=path)
    if inspect.iscoroutinefunction(fn):
        raise RewardFileError(f"{function} is 'async def': rewards are called as plain "
                              f"functions; define def {function}{_CALL}", path=path)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: its first call will tell
        return fn  # type: ignore[no-any-return]
    try:
        signature.bind(**dict.fromkeys(PARAMETERS))
    except TypeError as exc:
        raise RewardFileError(
            f"{function}{signature} cannot be called as {function}"
            f"({', '.join(f'{p}=...' for p in PARAMETERS)}) ({exc}): take these four "
            "parameters by these names (extra_info may default to None), or **kwargs",
            path=path) from None
    return fn  # type: ignore[no-any-return]


def _normalise(result: Any, function: str) -> dict[str, Any]:
    """{"score": float, "extra": {name: float}} from a number or a dict with "score"."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"{function} returned a dict without 'score' (keys: "
                             f"{', '.join(map(str, list(result)[:10]))}): put the reward "
                             "under 'score'")
        score = _number(result["score"])
        if score is None:
            raise ValueError(f"{function} returned score={result['score']!r:.80}, not a "
                             "number")
        extra = {k: v for k, raw in result.items() if k != "score"
                 and (v := _number(raw)) is not None and v == v and abs(v) != float("inf")}
        check_metrics(extra, where=f"{function}'s dict")
        return {"score": score, "extra": extra}
    score = _number(result)
    if score is None:
        raise ValueError(f"{function} returned {result!r:.80} (a {type(result).__name__}): "
                         "return a number, or a dict with a numeric 'score'")
    return {"score": score, "extra": {}}


def _number(value: Any) -> float | None:
    """A real number (bools and numpy scalars included) as a float; None otherwise."""
    return float(value) if isinstance(value, numbers.Real) else None
