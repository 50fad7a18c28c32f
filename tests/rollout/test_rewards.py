from __future__ import annotations

import threading
import time

import pytest

from rollout.errors import UnknownRewardError
from rollout.rewards import (
    MathVerifyReward,
    default_reward_for,
    exact_match,
    get_reward,
    register_reward,
    reward_names,
)
from rollout.tasks import REVERSE_SOURCE


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
    # Unguarded, sympy expands this for minutes.
    assert reward("\\boxed{(x+1)^{100000}}", "5") == 0.0
    assert time.monotonic() - start < 15


def test_math_reward_works_off_the_main_thread() -> None:
    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(get_reward("math")("\\boxed{4}", "4")))
    worker.start()
    worker.join(timeout=60)
    assert results == [1.0]


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
