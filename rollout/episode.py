"""Episodes: what an agent plugin returns, and the one training sample each becomes.

An episode is the model's turns in one task, each with the exact token ids
the engine saw and produced and the log-probabilities it reported, plus the
reward.  For training it becomes one TrajectorySample:

    prompt     the first turn's prompt ids
    response   turn 1's response, then the tokens between it and turn 2's
               response (the environment's and the chat template's: taken
               from turn 2's prompt), then turn 2's response, and so on
    mask       1 on the model's tokens (trained on), 0 on the others
    logprobs   the engine's on the model's tokens, 0.0 on the others

This is exact only if each turn's prompt continues the previous turn's
context token for token (prompt + response).  An engine that re-renders the
conversation through the chat template may not (the template can write an
end-of-turn token the model did not sample, or re-tokenise its text
differently): such an episode is refused with EpisodeError naming the turn
and the first differing position, never trained on guesses.
rollout/conversation.py keeps multi-turn exchanges exact by construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from rollout.chunk_format import FinishReason, TrajectorySample
from rollout.wire import CHAT, ProtocolError, parse_samples

MAX_TURNS: Final = 256


class EpisodeError(ValueError):
    """An agent's episode cannot be trained on as it is; the message says why."""


def _ids(values: Sequence[int], what: str) -> tuple[int, ...]:
    if not all(type(v) is int and v >= 0 for v in values):
        raise EpisodeError(f"{what} must be token ids (ints >= 0)")
    return tuple(values)


@dataclass(frozen=True)
class Turn:
    """One model turn: the whole context the engine saw, what it generated."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    text: str = ""
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", _ids(self.prompt_token_ids, "prompt ids"))
        object.__setattr__(self, "response_token_ids",
                           _ids(self.response_token_ids, "response ids"))
        logprobs = tuple(float(v) for v in self.response_logprobs)
        if len(logprobs) != len(self.response_token_ids) or not all(
                math.isfinite(v) and v <= 1e-4 for v in logprobs):
            raise EpisodeError(f"a turn of {len(self.response_token_ids)} response tokens needs "
                               "as many finite log-probabilities <= 0 (request logprobs and "
                               "return_token_ids from the engine)")
        object.__setattr__(self, "response_logprobs", logprobs)
        if not self.prompt_token_ids:
            raise EpisodeError("a turn needs a non-empty prompt")

    @classmethod
    def from_chat(cls, answer: Any, choice: int = 0) -> Turn:
        """A chat completion (a dict, or the openai client's ChatCompletion) asked with
        return_token_ids and logprobs, as a Turn; EpisodeError when it lacks them."""
        body = answer.model_dump() if hasattr(answer, "model_dump") else answer
        try:
            sample = parse_samples({**body, "choices": [body["choices"][choice]]}, 1, CHAT)[0]
        except (ProtocolError, KeyError, IndexError, TypeError) as exc:
            raise EpisodeError(f"a chat answer without its tokens ({exc}): send "
                               'extra_body={"return_token_ids": True} and logprobs=True') from exc
        return cls(sample.prompt_token_ids, sample.token_ids, sample.logprobs, sample.text,
                   sample.finish_reason)


@dataclass(frozen=True)
class Episode:
    """An agent's result for one task: its model turns and its reward.

    `reward` is the episode's; per-turn rewards, if the environment gives
    them, are summed into it by the agent (GRPO compares whole episodes).
    """

    turns: tuple[Turn, ...]
    reward: float

    def __post_init__(self) -> None:
        turns = tuple(self.turns)
        if not 1 <= len(turns) <= MAX_TURNS or not all(isinstance(t, Turn) for t in turns):
            raise EpisodeError(f"an episode needs 1..{MAX_TURNS} Turn records, got "
                               f"{len(turns)}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) \
                or not math.isfinite(self.reward):
            raise EpisodeError(f"reward={self.reward!r} is not a finite number")
        object.__setattr__(self, "turns", turns)

    def to_sample(self, task_id: str, index: int) -> TrajectorySample:
        """The training sample of this episode (see the module docstring)."""
        first = self.turns[0]
        context = list(first.prompt_token_ids) + list(first.response_token_ids)
        response = list(first.response_token_ids)
        mask = [1] * len(response)
        logprobs = list(first.response_logprobs)
        for n, turn in enumerate(self.turns[1:], start=2):
            prompt = turn.prompt_token_ids
            if prompt[: len(context)] != tuple(context):
                pairs = zip(prompt, context, strict=False)  # the shorter one's length
                at = next((i for i, (a, b) in enumerate(pairs) if a != b),
                          min(len(prompt), len(context)))
                raise EpisodeError(
                    f"turn {n}'s prompt does not continue turn {n - 1}'s context: they differ "
                    f"at token {at} of {len(context)} (the engine re-rendered the "
                    "conversation; use rollout.conversation.Conversation to continue at the "
                    "token level)")
            between = list(prompt[len(context):])
            response += between + list(turn.response_token_ids)
            mask += [0] * len(between) + [1] * len(turn.response_token_ids)
            logprobs += [0.0] * len(between) + list(turn.response_logprobs)
            context = list(prompt) + list(turn.response_token_ids)
        last = self.turns[-1]
        return TrajectorySample(
            task_id=task_id, sample_index=index, prompt_token_ids=list(first.prompt_token_ids),
            response_token_ids=response, response_logprobs=logprobs,
            response_text=last.text, reward=float(self.reward),
            finish_reason=FinishReason.LENGTH if last.finish_reason == "length"
            else FinishReason.STOP,
            response_mask=None if all(mask) else mask)


def failed_sample(task_id: str, index: int, error: str) -> TrajectorySample:
    """An episode that produced nothing to train on, recorded with why (never dropped)."""
    return TrajectorySample(
        task_id=task_id, sample_index=index, prompt_token_ids=(), response_token_ids=(),
        response_logprobs=(), response_text="", reward=0.0, finish_reason=FinishReason.ERROR,
        failed=True, error=error or "failed")
