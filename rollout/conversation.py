"""A multi-turn chat kept token-exact: what an agent plugin uses to talk to its engine.

    conv = Conversation(client, [{"role": "user", "content": "..."}])
    turn = conv.generate(max_tokens=64)         # a Turn: exact ids and log-probs
    conv.add([{"role": "user", "content": "tool says 42"}])
    turn = conv.generate(max_tokens=64)
    Episode(conv.turns, reward=...)             # rollout/episode.py

The first turn goes through the engine's chat endpoint (it applies the
model's chat template).  After that the conversation continues at the token
level: the next prompt is the previous context (prompt + the tokens the model
generated, exactly) followed by the tokens the chat template adds for the new
messages, which the engine's /tokenize gives as the difference between the
conversation rendered with and without them.  So every turn's prompt
continues the previous turn's context token for token and the episode trains
on exactly what the model saw and sampled; an agent that re-sends the whole
conversation through the chat endpoint gets a re-rendered prompt instead
(the template may write an end-of-turn token the model did not sample).

A chat template that rewrites earlier messages when new ones are appended
(some drop past reasoning) cannot be continued exactly: `add` raises
EpisodeError saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.client import CompletionClient
from rollout.episode import EpisodeError, Turn


class Conversation:
    """Messages, the exact token context behind them, and the model turns so far."""

    def __init__(self, client: CompletionClient, messages: Sequence[Mapping[str, str]]) -> None:
        if not messages:
            raise ValueError("a conversation starts with at least one message")
        self.client = client
        self.messages = [dict(m) for m in messages]
        self.context: list[int] | None = None  # None until the first turn
        self.turns: list[Turn] = []

    def generate(self, *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | None = None) -> Turn:
        """One model turn; its text joins the messages as the assistant's."""
        prompt: Any = self.messages if self.context is None else self.context
        (sample,) = self.client.complete_one(prompt, n=1, max_tokens=max_tokens,
                                             temperature=temperature, top_p=top_p, seed=seed,
                                             stop=stop)
        turn = Turn(sample.prompt_token_ids, sample.token_ids, sample.logprobs, sample.text,
                    sample.finish_reason)
        self.turns.append(turn)
        self.context = list(turn.prompt_token_ids) + list(turn.response_token_ids)
        self.messages.append({"role": "assistant", "content": sample.text})
        return turn

    def add(self, messages: Sequence[Mapping[str, str]]) -> None:
        """Append the environment's (or the user's) messages before the next turn."""
        if self.context is None:
            self.messages += [dict(m) for m in messages]
            return
        before = self.client.tokenize(self.messages, add_generation_prompt=False)
        after = self.client.tokenize(self.messages + [dict(m) for m in messages],
                                     add_generation_prompt=True)
        if after[: len(before)] != before:
            raise EpisodeError(
                "the chat template renders the earlier messages differently once new ones are "
                "appended, so the conversation cannot continue token for token")
        self.context += after[len(before):]
        self.messages += [dict(m) for m in messages]
