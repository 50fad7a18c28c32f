"""A completions request as rollout.hf.server reads it: vLLM's fields, strictly checked.

    prompt            a string, a list of strings, a list of token ids, or a
                      list of token-id lists (as vLLM accepts)
    n, max_tokens     samples per prompt; max_tokens may be 0 only with echo
    temperature, top_p, seed, stop
    logprobs          log-probabilities of the top k tokens at each position
    echo              the prompt's own tokens come back first, with their
                      log-probabilities (the first one null, as in vLLM)
    return_token_ids  prompt_token_ids and token_ids in each choice

`echo` with `max_tokens: 0` is how a caller reads the log-probabilities the
served weights give a fixed sequence (rl/probes.py), the same request vLLM
answers (its echo_without_generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

MAX_TOP_LOGPROBS: Final = 20  # vLLM's default --max-logprobs
DTYPES: Final = {
    "auto": "float32",
    "float": "float32",
    "float32": "float32",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
}

Prompt = str | tuple[int, ...]


class BadRequest(ValueError):
    """The request is invalid; the message goes back to the client with a 400."""


def _prompts(body: dict[str, Any]) -> tuple[Prompt, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return (tuple(prompt),)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt):
        return tuple(tuple(p) for p in prompt)
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of token-id lists, none of them empty")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    echo: bool = False
    return_token_ids: bool = False

    @classmethod
    def from_json(cls, body: Any) -> CompletionRequest:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        prompts = _prompts(body)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported: send stream=false")

        def number(name: str, default: Any, kind: type) -> Any:
            v = body.get(name, default)
            if v is None:
                return default
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (kind is int and not isinstance(v, int))
            ):
                raise BadRequest(
                    f"{name}={v!r} is not a{'n integer' if kind is int else ' number'}"
                )
            return kind(v)

        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a non-empty string or a list of them")
        req = cls(
            prompts=prompts,
            n=number("n", 1, int),
            max_tokens=number("max_tokens", 16, int),
            temperature=number("temperature", 1.0, float),
            top_p=number("top_p", 1.0, float),
            seed=None if body.get("seed") is None else number("seed", 0, int),
            logprobs=None if body.get("logprobs") is None else number("logprobs", 0, int),
            stop=tuple(stop),
            echo=bool(body.get("echo") or False),
            return_token_ids=bool(body.get("return_token_ids") or False),
        )
        req.check()
        return req

    def check(self) -> None:
        # vLLM: max_tokens 0 means "echo the prompt, generate nothing" and is
        # refused without echo (SamplingParams needs at least one token).
        if self.n < 1 or self.max_tokens < (0 if self.echo else 1):
            raise BadRequest(f"n={self.n} must be >= 1 and max_tokens={self.max_tokens} >= 1 "
                             "(0 only with echo)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise BadRequest(
                f"temperature={self.temperature} must be >= 0 and top_p={self.top_p} in (0, 1]"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs={self.logprobs} is outside 0..{MAX_TOP_LOGPROBS}")
