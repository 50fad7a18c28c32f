from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.errors import UnknownRewardError
from rollout.guarded_call import GuardedWorker
from rollout.reward_tally import RewardTally, tallying
from rollout.rewards import (
    MathVerifyReward,
    default_reward_for,
    exact_match,
    get_reward,
    math_score,
    register_reward,
    reward_names,
    text_scorer,
)
from rollout.tasks import REVERSE_SOURCE, Task


def test_exact_match_ignores_surrounding_whitespace_only() -> None:
    assert exact_match(" 1204\n", "1204") == 1.0
    assert exact_match("12 04", "1204") == 0.0
    assert exact_match("", "1204") == 0.0


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("So the answer is \\boxed{72}.", "72", 1.0),
        ("Natalia sold 48/2 = 24 clips in May. #### 72", "72", 1.0),
        ("half of it: \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "1/2", 1.0),
        ("I think it is \\boxed{73}", "72", 0.0),
        ("", "72", 0.0),
        ("}}}{{{\\frac{\\boxed{", "72", 0.0),
    ],
)
def test_math_reward_checks_equivalence_and_scores_unparsable_output_zero(
    response: str, truth: str, reward: float
) -> None:
    assert get_reward("math")(response, truth) == reward


def test_math_reward_times_out_on_pathological_answers_instead_of_hanging() -> None:
    reward = MathVerifyReward(timeout_seconds=1)
    start = time.monotonic()
    # Unguarded, sympy expands this for minutes; an alarm alone once let it run
    # 579 s in CI.  The worker is killed at 3 * 1 + 1 s; the rest is its start.
    assert reward("\\boxed{(x+1)^{100000}}", "5") == 0.0
    assert time.monotonic() - start < 30
    assert reward("\\boxed{4}", "4") == 1.0  # a new worker scores the next one


def test_math_reward_works_and_is_bounded_off_the_main_thread() -> None:
    results: list[float] = []
    reward = MathVerifyReward(timeout_seconds=1)

    def score() -> None:
        results.append(reward("\\boxed{4}", "4"))
        results.append(reward("\\boxed{(x+1)^{100000}}", "5"))

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0, 0.0]


def test_math_reward_refuses_a_timeout_below_one_second() -> None:
    with pytest.raises(ValueError, match="timeout_seconds=0 is below 1"):
        MathVerifyReward(timeout_seconds=0)


def test_unknown_reward_name_lists_the_known_names() -> None:
    with pytest.raises(UnknownRewardError, match="unknown reward 'f1': known rewards are") as info:
        get_reward("f1")
    assert {"exact_match", "math"} <= set(info.value.known)
    assert "exact_match" in str(info.value)


def test_registered_rewards_are_found_and_names_cannot_be_taken_twice() -> None:
    def always_one(response: str, truth: str) -> float:
        return 1.0

    register_reward("test_always_one", always_one)
    assert get_reward("test_always_one") is always_one
    assert "test_always_one" in reward_names()
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_one", always_one)


def test_default_reward_follows_the_data_source() -> None:
    assert default_reward_for(REVERSE_SOURCE) == "exact_match"
    assert default_reward_for("openai/gsm8k") == "math"
    assert default_reward_for("DigitalLearningGmbH/MATH-lighteval") == "math"
    with pytest.raises(UnknownRewardError, match="'my/code' has no default reward"):
        default_reward_for("my/code")


def test_a_reward_an_installed_package_provides_is_found_by_its_entry_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout import rewards
    from tests.support.plugins import install_entry_points

    site = install_entry_points(tmp_path, "my-rewards", {"coordinator.rewards": {
        "always_half": "tests.rollout.test_rewards:always_half",
        "broken": "no_such_module_anywhere:fn"}})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))
    assert {"always_half", "broken", "exact_match"} <= set(reward_names())
    assert get_reward("always_half")("x", "y") == 0.5
    with pytest.raises(UnknownRewardError, match=r"reward 'broken' \(no_such_module_anywhere:fn"
                       r", entry point of coordinator.rewards\) cannot be loaded"):
        get_reward("broken")


def always_half(response: str, ground_truth: str) -> float:
    return 0.5


def test_a_reward_that_raises_fails_its_sample_not_the_rollout() -> None:
    from rollout.sampling_agent import samples_of
    from rollout.tasks import Task
    from rollout.wire import GroupResult, Sample

    task = Task(task_id="t/1", prompt="12>", ground_truth="21", data_source="x", split="train")
    group = GroupResult(index=0, prompt="12>", samples=tuple(
        Sample(text=t, token_ids=(1,), logprobs=(-0.1,), prompt_token_ids=(5,),
               finish_reason="stop") for t in ("21", "boom", "nan")))

    def picky(response: str, truth: str) -> float:
        if response == "boom":
            raise KeyError("no such field")
        return float("nan") if response == "nan" else float(response == truth)

    out = samples_of(task, group, 3, text_scorer(picky), reward_name="picky")
    assert [s.failed for s in out] == [False, True, True] and out[0].reward == 1.0
    assert out[1].error == "task t/1: the reward 'picky' raised KeyError: 'no such field'"
    assert "gave nan, not a finite number" in out[2].error


ANSWERS = [("So the answer is \\boxed{72}.", "72"), ("48/2 = 24 clips. #### 72", "72"),
           ("half of it: \\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{\\frac{2}{4}}", "1/2"),
           ("I think it is \\boxed{73}", "72"), ("\\boxed{3^2}", "9")]


class MathAgent:
    """An agent plugin scoring a fixed answer per task with the math reward, in its
    episode's own thread, as a real multi-turn agent would at its end."""

    def run(self, task: Task, engine: object) -> object:
        from rollout.episode import Episode, Turn

        reward = get_reward("math")(str(task.prompt), task.ground_truth)
        return Episode((Turn((1, 2), (5,), (-0.5,), "x"),), reward)


def test_a_multi_threaded_agent_on_the_math_reward_scores_as_in_process_scoring() -> None:
    """Issue 32, finding 2: the reward worker was SIGKILLed whenever the episode thread
    that had started it ended, and the call in flight scored 0.0."""
    from rollout.agents import EngineEndpoint, EpisodeRunner
    from rollout.client import CompletionClient

    tasks = [Task(task_id=f"math/{i}", prompt=answer, ground_truth=truth, data_source="gsm8k",
                  split="train") for i, (answer, truth) in enumerate(ANSWERS)]
    engine = EngineEndpoint("http://127.0.0.1:9", "k", "policy",
                            CompletionClient("http://127.0.0.1:9", "k", model="policy"))
    runner = EpisodeRunner(MathAgent(), engine, concurrency=4,  # type: ignore[arg-type]
                           timeout_s=120.0)
    with tallying(RewardTally()) as tally:
        groups = list(runner.iter_groups(tasks, group_size=3))
    got = {t.task_id: [s.reward for s in samples] for t, samples in groups}
    expected = {t.task_id: [math_score(str(t.prompt), t.ground_truth, 5)] * 3 for t in tasks}
    assert got == expected
    assert {r for scores in expected.values() for r in scores} == {0.0, 1.0}  # tells them apart
    assert all(not s.failed for _, samples in groups for s in samples)
    assert (tally.calls, tally.timeouts) == (18, 0)


def stalled_score(response: str, ground_truth: str, timeout_seconds: int) -> float:
    """math_score's place in the worker: sleeps `response` seconds, then scores 1."""
    time.sleep(float(response))
    return 1.0


@pytest.fixture
def stalled_math(monkeypatch: pytest.MonkeyPatch) -> Iterator[GuardedWorker]:
    """The math reward's worker computing stalled_score instead: calls that overrun
    or die on cue, whatever sympy does on this machine."""
    from rollout import rewards

    worker = GuardedWorker("tests.rollout.test_rewards:stalled_score")
    monkeypatch.setattr(rewards, "_MATH_WORKER", worker)
    yield worker
    worker.close()


def test_a_math_reward_call_that_runs_out_of_time_scores_zero_and_is_counted(
        stalled_math: GuardedWorker) -> None:
    reward = MathVerifyReward(timeout_seconds=1)
    with tallying(RewardTally()) as tally:
        assert reward("0", "4") == 1.0
        start = time.monotonic()
        assert reward("600", "4") == 0.0  # killed at 3 x 1 + 1 s
        assert time.monotonic() - start < 30
        assert reward("0", "4") == 1.0  # a new worker scores the next one
    # The zero is counted (the iteration's reward_timeouts), not passed off as a verdict.
    assert (tally.calls, tally.timeouts) == (3, 1)


def test_a_reward_whose_worker_dies_fails_its_sample_naming_the_cause_never_scores(
        stalled_math: GuardedWorker) -> None:
    import os
    import signal

    from rollout.sampling_agent import samples_of
    from rollout.wire import GroupResult, Sample

    reward = MathVerifyReward(timeout_seconds=5)
    assert reward("0", "4") == 1.0  # the worker is up
    pid = stalled_math.pid
    assert pid is not None
    task = Task(task_id="t/1", prompt="p", ground_truth="5", data_source="gsm8k", split="train")
    group = GroupResult(index=0, prompt="p", samples=(Sample(
        text="60", token_ids=(1,), logprobs=(-0.1,), prompt_token_ids=(5,),
        finish_reason="stop"),))
    # Killed mid-call, as the kernel's OOM killer would (the call's deadline is 16 s).
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with tallying(RewardTally()) as tally:
            out = samples_of(task, group, 1, text_scorer(reward), reward_name="math")
    finally:
        killer.cancel()
    assert out[0].failed and out[0].reward == 0.0
    assert out[0].error.startswith(
        "task t/1: the reward 'math' raised WorkerDied: tests.rollout.test_rewards:stalled_score:"
        f" the worker process (pid {pid}) died during the call: killed by SIGKILL (-9)"
    ), out[0].error
    assert (tally.calls, tally.timeouts) == (0, 0)  # neither a score nor a timeout
