"""A multi-turn chat kept token-exact: what an agent plugin uses to talk to its engine.

    conv = Conversation(client, [{"role": "user", "content": "..."}])
    turn = conv.generate(max_tokens=64)         # a Turn: exact ids and log-probs
    conv.add([{"role": "user", "content": "tool says 42"}])
    turn = conv.generate(max_tokens=64)
    Episode(conv.turns, reward=...)             # rollout/episode.py

A model without a chat format starts from a text prompt instead
(`Conversation(client, "2+2=")`) and is continued with text (`conv.add("...")`,
its tokens from the engine's /tokenize); text can be added to a chat as well.

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

    def __init__(self, client: CompletionClient,
                 start: Sequence[Mapping[str, str]] | str) -> None:
        """`start`: chat messages (the chat endpoint renders them), or a text prompt
        for a model without a chat format (the completions endpoint)."""
        if not start:
            raise ValueError("a conversation starts with a message or a prompt")
        self.client = client
        self.text = start if isinstance(start, str) else None
        self.messages = [] if isinstance(start, str) else [dict(m) for m in start]
        self.context: list[int] | None = None  # None until the first turn
        self.turns: list[Turn] = []

    def generate(self, *, max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | None = None) -> Turn:
        """One model turn; its text joins the messages as the assistant's."""
        prompt: Any = self.context if self.context is not None else \
            self.text if self.text is not None else self.messages
        (sample,) = self.client.complete_one(prompt, n=1, max_tokens=max_tokens,
                                             temperature=temperature, top_p=top_p, seed=seed,
                                             stop=stop)
        turn = Turn(sample.prompt_token_ids, sample.token_ids, sample.logprobs, sample.text,
                    sample.finish_reason)
        self.turns.append(turn)
        self.context = list(turn.prompt_token_ids) + list(turn.response_token_ids)
        self.messages.append({"role": "assistant", "content": sample.text})
        return turn

    def add(self, new: Sequence[Mapping[str, str]] | str) -> None:
        """Append the environment's (or the user's) messages, or plain text (its
        tokens as the engine's tokenizer makes them), before the next turn."""
        if isinstance(new, str):
            if self.context is None:
                raise ValueError("add text after the first turn (start with the prompt)")
            self.context += self.client.tokenize_text(new)
            return
        messages = new
        if self.text is not None:
            raise ValueError("a conversation started from a text prompt takes text, not "
                             "chat messages")
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
