"""One rollout client for both servers (rollout.hf.server and `vllm serve`).

Text prompts go to /v1/completions, chat messages to /v1/chat/completions
(the engine applies the chat template); rollout/wire.py has the request
bodies and the strict reading of the answers: exact token ids and their
log-probabilities, or a ProtocolError.

One prompt is one request (its n samples form a GRPO group), so a failure
costs one group.  A group that still fails after the retries comes back as a
GroupResult with its error text: nothing is dropped silently.

Requests are held without a thread each: httpx's asynchronous client runs
`concurrency` of them at once on one event loop (in a helper thread), so a
vLLM server's batch stays full (hundreds in flight) at the cost of one
thread.  `iter_groups` hands results back in prompt order as soon as each
prefix is complete, so a caller checkpoints in a deterministic order while
later requests are still running.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Final

import httpx
import tenacity

from rollout.wire import (
    ClientError,
    GroupResult,
    HttpError,
    Prompt,
    ProtocolError,
    Sample,
    TransientError,
    parse_choice,
    parse_samples,
    prompt_label,
    request_body,
)

__all__ = ["ClientError", "CompletionClient", "GroupResult", "HttpError", "ProtocolError",
           "Sample", "TransientError", "parse_choice"]
log = logging.getLogger(__name__)

# Statuses a healthy server can return under load or while restarting.
_TRANSIENT_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_ERROR_BODY: Final = 2000
# While a group is awaited, the caller's cancel check runs this often: well within the
# daemon's grace for its main thread to stop after a failure elsewhere (seconds).
_CANCEL_CHECK_S: Final = 0.2


class CompletionClient:
    """At most `concurrency` completion requests at once: `iter_groups` and
    `generate_groups` keep that many in flight, and `complete_one`, which agent
    episodes call from their own threads, waits for a free slot."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        model: str | None = None,
        concurrency: int = 8,
        request_timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        sleep: Callable[[float], Awaitable[None] | None] = asyncio.sleep,
        health_check: Callable[[], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} is below 1: allow at least one request")
        if retries < 0:
            raise ValueError(f"retries={retries} is negative: use 0 for a single attempt")
        if request_timeout_s <= 0 or backoff_s < 0 or backoff_max_s < backoff_s:
            raise ValueError(
                f"request_timeout_s={request_timeout_s} must be > 0 and "
                f"0 <= backoff_s={backoff_s} <= backoff_max_s={backoff_max_s}"
            )
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._model = model
        self._model_lock = threading.Lock()
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        # Called before each retry: an engine's check_alive turns "connection
        # refused" into "the server died with SIGKILL, here is its log".
        self._health_check = health_check

    # --- transport ---------------------------------------------------------

    def _answer(self, resp: httpx.Response, url: str, parse: bool) -> Any:
        if resp.status_code >= 400:
            text = resp.text
            if resp.status_code in _TRANSIENT_STATUS:
                raise TransientError(f"HTTP {resp.status_code} from {url}: "
                                     f"{text[:_MAX_ERROR_BODY]}", status=resp.status_code)
            raise HttpError(resp.status_code, text, url)
        if not parse:
            return resp.content
        try:
            return json.loads(resp.content)
        except ValueError as e:  # a response cut short by a dying server
            raise TransientError(f"unparsable JSON from {url}: {resp.content[:200]!r}") from e

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *,
        params: dict[str, Any] | None = None, timeout_s: float | None = None,
        parse: bool = True, headers: dict[str, str] | None = None,
    ) -> Any:
        """One synchronous request (control endpoints, tests); ClientError on failure."""
        url = self.base_url + path
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        try:
            with httpx.Client(timeout=timeout) as http:
                resp = http.request(method, url, json=body, params=params,
                                    headers={**self._headers, **(headers or {})})
        except httpx.TimeoutException as e:
            raise TransientError(f"no answer from {url} within {timeout:g}s") from e
        except httpx.TransportError as e:
            raise TransientError(f"cannot reach {url}: {e}") from e
        return self._answer(resp, url, parse)

    async def _arequest(self, http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
        url = self.base_url + path
        try:
            resp = await http.post(url, json=body, headers=self._headers)
        except httpx.TimeoutException as e:
            raise TransientError(
                f"no answer from {url} within {self.request_timeout_s:g}s") from e
        except httpx.TransportError as e:
            raise TransientError(f"cannot reach {url}: {e}") from e
        return self._answer(resp, url, parse=True)

    def health(self, timeout_s: float = 5.0) -> None:
        """GET /health: 200 once the server serves (vLLM's body is empty), else TransientError."""
        self.request("GET", "/health", timeout_s=timeout_s, parse=False)

    def models(self) -> list[str]:
        body = self.request("GET", "/v1/models")
        try:
            return [str(m["id"]) for m in body["data"]]
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"/v1/models answer has no data[].id: {str(body)[:200]}") from e

    @property
    def model(self) -> str:
        with self._model_lock:
            if self._model is None:
                names = self.models()
                if not names:
                    raise ProtocolError(f"{self.base_url} serves no model")
                self._model = names[0]
            return self._model

    # --- one request --------------------------------------------------------

    def tokenize(self, messages: Sequence[Mapping[str, str]], *,
                 add_generation_prompt: bool) -> list[int]:
        """POST /tokenize: the token ids the model's chat template makes of `messages`."""
        body = {"model": self.model, "messages": [dict(m) for m in messages],
                "add_generation_prompt": add_generation_prompt}
        return self._tokens(self.request("POST", "/tokenize", body))

    def tokenize_text(self, text: str) -> list[int]:
        """POST /tokenize of plain text, without the tokenizer's special tokens."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return self._tokens(self.request("POST", "/tokenize", body))

    @staticmethod
    def _tokens(answer: Any) -> list[int]:
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ProtocolError(f"/tokenize answered without tokens: {str(answer)[:200]}")
        return tokens

    def complete_one(self, prompt: Prompt, *, n: int, max_tokens: int, **kw: Any,
                     ) -> list[Sample]:
        """One attempt: n samples of `prompt`, in choice order.  Raises ClientError.
        Waits while `concurrency` other calls are in flight."""
        path, body = request_body(prompt, model=self.model, n=n, max_tokens=max_tokens, **kw)
        with self._slots:
            answer = self.request("POST", path, body)
        return parse_samples(answer, n, path)

    # --- groups ---------------------------------------------------------------

    def generate_groups(self, prompts: Sequence[Prompt], **kw: Any) -> list[GroupResult]:
        """One GroupResult per prompt, in prompt order (see `iter_groups`)."""
        return list(self.iter_groups(prompts, **kw))

    def iter_groups(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        check_cancel: Callable[[], None] = lambda: None,
    ) -> Generator[GroupResult, None, None]:
        """GroupResults in prompt order, each as soon as it and those before it are done,
        with up to `concurrency` requests in flight.  `check_cancel` is called while
        waiting for a group: what it raises (the group stopping: a peer failed) ends
        the iteration at once instead of after the group in flight.

        `seeds` gives each group its own seed (a group redone after a restart then
        samples the same way whatever else is redone with it); a single `seed`
        gives group i seed + i, so identical prompts still get independent
        samples.  Leaving the iteration early cancels the requests still running.
        """
        if n < 1 or max_tokens < 1:
            raise ValueError(f"n={n} and max_tokens={max_tokens} must both be >= 1")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one each")
        if not prompts:
            return
        per_group = list(seeds) if seeds is not None else \
            [None if seed is None else seed + i for i in range(len(prompts))]
        bodies = [request_body(p, model=self.model, n=n, max_tokens=max_tokens,
                               temperature=temperature, top_p=top_p, seed=per_group[i],
                               stop=stop)
                  for i, p in enumerate(prompts)]
        done: dict[int, GroupResult] = {}
        ready = threading.Condition()
        stop_event = threading.Event()
        runner = threading.Thread(
            target=lambda: asyncio.run(self._run_groups(prompts, bodies, n, done, ready,
                                                        stop_event)),
            name="completions", daemon=True)
        runner.start()
        try:
            for i in range(len(prompts)):
                with ready:
                    while i not in done:
                        if not runner.is_alive() and i not in done:
                            raise ClientError("the completions loop stopped unexpectedly")
                        check_cancel()
                        ready.wait(_CANCEL_CHECK_S)
                    result = done.pop(i)
                yield result
        finally:
            stop_event.set()
            runner.join()

    async def _run_groups(self, prompts: Sequence[Prompt],
                          bodies: list[tuple[str, dict[str, Any]]], n: int,
                          done: dict[int, GroupResult], ready: threading.Condition,
                          stop_event: threading.Event) -> None:
        limits = httpx.Limits(max_connections=self.concurrency,
                              max_keepalive_connections=self.concurrency)
        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.request_timeout_s, limits=limits) as http:

            async def one(i: int) -> None:
                async with gate:
                    result = await self._group(http, i, prompts[i], bodies[i], n)
                with ready:
                    done[i] = result
                    ready.notify_all()

            tasks: list[asyncio.Task[Any]] = [asyncio.create_task(one(i))
                                              for i in range(len(prompts))]
            watcher: asyncio.Task[Any] = asyncio.create_task(asyncio.to_thread(stop_event.wait))
            pending = set(tasks)
            while pending and not watcher.done():
                _, pending = await asyncio.wait(
                    pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(watcher)
            for task in pending:  # the consumer left: whatever still runs is cancelled
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if not watcher.done():
                stop_event.set()
            await watcher

    async def _pause(self, seconds: float) -> None:
        result = self._sleep(seconds)
        if inspect.isawaitable(result):
            await result

    async def _group(self, http: httpx.AsyncClient, index: int, prompt: Prompt,
                     request: tuple[str, dict[str, Any]], n: int) -> GroupResult:
        path, body = request
        attempts = 0

        async def attempt() -> list[Sample]:
            nonlocal attempts
            attempts += 1
            return parse_samples(await self._arequest(http, path, body), n, path)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("prompt %d attempt %d failed (%s); retrying", index, attempts, exc)
            if self._health_check is not None:
                self._health_check()

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=tenacity.wait_exponential(multiplier=self.backoff_s, max=self.backoff_max_s),
            retry=tenacity.retry_if_exception_type(TransientError),
            sleep=self._pause,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            try:
                samples: list[Sample] = await retrying(attempt)
            except TransientError:
                # The last failure may be the server's death: let the health
                # check name it (exit status, log) instead of "connection refused".
                if self._health_check is not None:
                    self._health_check()
                raise
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed group is a result, never a lost prompt
            log.error("prompt %d failed after %d attempts: %s", index, attempts, e)
            return GroupResult(
                index=index, prompt=prompt_label(prompt), error=f"{type(e).__name__}: {e}",
                attempts=attempts
            )
        return GroupResult(index=index, prompt=prompt_label(prompt), samples=tuple(samples),
                           attempts=attempts)
