"""The wire format both servers speak: request bodies, and strict parsing of the answers.

One rollout request asks for the n samples of one prompt (a GRPO group):

    a text prompt       POST /v1/completions, `prompt`, `logprobs: 0`
    chat messages       POST /v1/chat/completions, `messages`, `logprobs: true`,
                        `top_logprobs: 0`; the engine applies the model's chat
                        template, so nothing is rendered or tokenised here

both with `return_token_ids: true` (vLLM >= 0.10.2, and rollout.hf.server).
An answer is read as vLLM's CompletionResponse or ChatCompletionResponse:
each sample's exact prompt and response token ids and the policy's
log-probability of each response token.  The trainer needs exactly those, so
an answer without them is a ProtocolError, never a guess from re-tokenised
text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rollout.engines.config import EngineError

_MAX_ERROR_BODY: Final = 2000
COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
# A prompt is text or token ids (the completions endpoint), or chat messages
# ({"role", "content"}) for the chat endpoint.
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


class ClientError(EngineError):
    """A completion request failed."""


class TransientError(ClientError, ConnectionError):
    """Connection refused/reset, timeout or a 5xx/429: worth retrying."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when the server answered


class HttpError(ClientError):
    """The server rejected the request (4xx other than 408/425/429): not retried."""

    def __init__(self, status: int, body: str, url: str) -> None:
        self.status = status
        self.body = body
        self.url = url
        super().__init__(f"HTTP {status} from {url}: {body[:_MAX_ERROR_BODY]}")


class ProtocolError(ClientError, ValueError):
    """The response does not have the shape both servers promise."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion: exact token ids and the policy's log-prob of each."""

    text: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens: "
                "there must be one log-probability per generated token"
            )


@dataclass(frozen=True, kw_only=True)
class GroupResult:
    """The n samples of one prompt, or why there are none."""

    index: int
    prompt: str  # for logs and errors (prompt_label)
    samples: tuple[Sample, ...] = ()
    error: str | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def _ids(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ProtocolError(
            f"{what} is missing or not a list of token ids: the server must honour "
            "return_token_ids (vLLM >= 0.10.2, or rollout.hf.server)"
        )
    return tuple(value)


def parse_choice(choice: Any) -> Sample:
    """A vLLM-shaped completion choice -> Sample (strict)."""
    if not isinstance(choice, dict):
        raise ProtocolError(f"choice is {type(choice).__name__}, not an object")
    text = choice.get("text")
    finish = choice.get("finish_reason")
    if not isinstance(text, str) or not isinstance(finish, str):
        raise ProtocolError(f"choice lacks text or finish_reason: {str(choice)[:200]}")
    token_ids = _ids(choice.get("token_ids"), "token_ids")
    prompt_ids = _ids(choice.get("prompt_token_ids"), "prompt_token_ids")
    lp = choice.get("logprobs")
    raw = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if not isinstance(raw, list) or len(raw) != len(token_ids):
        raise ProtocolError(
            f"logprobs.token_logprobs has {len(raw) if isinstance(raw, list) else 'no'} entries "
            f"for {len(token_ids)} tokens: request logprobs=0 and return_token_ids=true"
        )
    return Sample(
        text=text,
        prompt_token_ids=prompt_ids,
        token_ids=token_ids,
        logprobs=_logprobs(raw),
        finish_reason=finish,
    )


def prompt_label(prompt: Prompt) -> str:
    """A prompt for logs and errors: the text, or the last message's content."""
    if isinstance(prompt, str):
        return prompt
    if _is_ids(prompt):
        return f"<{len(prompt)} token ids>"
    last = prompt[-1] if prompt else None
    return str(last.get("content", "")) if isinstance(last, Mapping) else ""


def _is_ids(prompt: Prompt) -> bool:
    return not isinstance(prompt, str) and bool(prompt) and all(
        type(t) is int for t in prompt)


def request_body(prompt: Prompt, *, model: str, n: int, max_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] | None = None) -> tuple[str, dict[str, Any]]:
    """(path, body) of the request for `n` samples of `prompt`."""
    body: dict[str, Any] = {"model": model, "n": n, "max_tokens": max_tokens,
                            "temperature": temperature, "top_p": top_p,
                            "return_token_ids": True, "stream": False}
    if isinstance(prompt, str) or _is_ids(prompt):
        path = COMPLETIONS
        body.update(prompt=prompt if isinstance(prompt, str) else list(prompt), logprobs=0)
    else:
        path = CHAT
        body.update(messages=[dict(m) for m in prompt],  # type: ignore[arg-type]
                    logprobs=True, top_logprobs=0)
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = list(stop)
    return path, body


def parse_samples(resp: Any, n: int, path: str) -> list[Sample]:
    """The n samples of an answer, in choice order (strict)."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise ProtocolError(f"asked for n={n} choices, got {got}: {str(resp)[:200]}")
    choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    if path == CHAT:
        prompt_ids = _ids(resp.get("prompt_token_ids"), "prompt_token_ids")
        return [parse_chat_choice(c, prompt_ids) for c in choices]
    return [parse_choice(c) for c in choices]


def parse_chat_choice(choice: Any, prompt_token_ids: tuple[int, ...]) -> Sample:
    """A vLLM-shaped chat choice (with the answer's prompt_token_ids) -> Sample (strict)."""
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise ProtocolError(f"chat choice lacks a message: {str(choice)[:200]}")
    text = choice["message"].get("content")
    finish = choice.get("finish_reason")
    if not isinstance(text, (str, type(None))) or not isinstance(finish, str):
        raise ProtocolError(f"chat choice lacks content or finish_reason: {str(choice)[:200]}")
    token_ids = _ids(choice.get("token_ids"), "token_ids")
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list) or len(content) != len(token_ids) or not all(
            isinstance(c, dict) for c in content):
        raise ProtocolError(
            f"logprobs.content has {len(content) if isinstance(content, list) else 'no'} "
            f"entries for {len(token_ids)} tokens: request logprobs=true and "
            "return_token_ids=true")
    return Sample(text=text or "", prompt_token_ids=prompt_token_ids, token_ids=token_ids,
                  logprobs=_logprobs([c.get("logprob") for c in content]), finish_reason=finish)


def _logprobs(raw: list[Any]) -> tuple[float, ...]:
    values = []
    for v in raw:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v > 1e-4:
            raise ProtocolError(f"token log-prob {v!r} is not a number <= 0")
        values.append(float(v))
    return tuple(values)
