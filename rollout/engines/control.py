"""An engine's control calls: sleep, in-place weight reload and prompt log-probabilities.

One sequence serves both kinds: `vllm serve` with VLLM_SERVER_DEV_MODE=1 and
--enable-sleep-mode, and the hf server, which answers the same routes with
the same shapes (rollout/hf/control.py).  The calls, as vLLM 0.29.0 takes them:

    sleep(level)        POST /sleep?level=L&mode=abort       requests in flight are aborted
                        GET  /is_sleeping  -> true           or WeightUpdateError
    load_weights(dir)   POST /wake_up?tags=weights           weight memory back (garbage at level 2)
                        POST /collective_rpc                 {"method": "reload_weights",
                                                              "kwargs": {"weights_path": dir}}
                        POST /wake_up?tags=kv_cache          the scheduler runs again
                        POST /reset_prefix_cache             until {"success": true}: no block
                                                             computed with the old weights is reused
                        GET  /is_sleeping  -> false
    wake_up()           POST /wake_up                        everything (level 1: the old weights)
    update_weights(dir) POST /pause?mode=wait                requests in flight finish, new ones
                                                             wait (the engine stays awake)
                        POST /collective_rpc reload_weights  as above
                        POST /reset_prefix_cache             as above
                        POST /resume                         the queued requests run
                        GET  /is_paused -> false
    prompt_logprobs     POST /v1/completions {"prompt": [[ids]], "echo": true, "logprobs": 0,
                        "max_tokens": 0}  with X-data-parallel-rank: r for one replica

Version notes (read in vLLM's released wheels, see docs/PROTOCOL.md):
reload_weights takes weights_path from 0.16.0; /pause, /resume and
/is_paused (entrypoints/serve/dev/rlhf) are in 0.29.0; /sleep takes mode from
0.24.0; /reset_prefix_cache answers {"success": bool} from 0.26.0 (an
empty 200 before, read here as success).  Under data parallelism every
call is broadcast to all replicas and answered by replica 0, which is why
the served weights are checked per replica with the header.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from rollout.client import ClientError, CompletionClient
from rollout.engines.config import EngineError

log = logging.getLogger("rollout.engines.engine")

PREFIX_RESET_ATTEMPTS: Final = 20
PREFIX_RESET_PAUSE_S: Final = 0.25
DP_RANK_HEADER: Final = "X-data-parallel-rank"


class WeightUpdateError(EngineError):
    """One step of sleep / wake / reload failed; `step` names it."""

    def __init__(self, step: str, reason: str) -> None:
        self.step = step
        self.reason = reason
        super().__init__(f"{step} failed: {reason}")


class EngineControl:
    """The control calls against one server; every failure is a WeightUpdateError."""

    def __init__(self, client: CompletionClient, *, reload_timeout_s: float,
                 pause: Callable[[float], None] = time.sleep) -> None:
        self.client = client
        self.reload_timeout_s = reload_timeout_s
        self._pause = pause

    def _call(self, step: str, method: str, path: str, *, body: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """The answer's JSON, or None for vLLM's empty 200."""
        try:
            raw = self.client.request(method, path, body, params=params, timeout_s=timeout_s,
                                      parse=False)
        except ClientError as exc:
            raise self._unanswered(step, exc) from exc
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise WeightUpdateError(step, f"the answer is not JSON: {raw[:200]!r}") from None

    def _unanswered(self, step: str, exc: ClientError) -> WeightUpdateError:
        # Each control request waits at most engine.request_timeout_s (the engine's
        # client's bound, the reload's too): named, as a hung GPU shows up here.
        return WeightUpdateError(step, f"{exc} (a control request waits at most "
                                 f"engine.request_timeout_s={self.reload_timeout_s:g} s)")

    def is_sleeping(self) -> bool:
        answer = self._call("GET /is_sleeping", "GET", "/is_sleeping")
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            raise WeightUpdateError("GET /is_sleeping", f"unexpected answer {answer!r}")
        return bool(answer["is_sleeping"])

    def _expect_sleeping(self, step: str, want: bool) -> None:
        if self.is_sleeping() is not want:
            raise WeightUpdateError(step, f"the server answered but /is_sleeping says "
                                    f"{not want}: is the server started with sleep mode on?")

    def sleep(self, level: int) -> None:
        step = f"POST /sleep?level={level}"
        self._call(step, "POST", "/sleep", params={"level": level, "mode": "abort"})
        self._expect_sleeping(step, True)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        step = "POST /wake_up" + (f"?tags={','.join(tags)}" if tags else "")
        self._call(step, "POST", "/wake_up", params={"tags": list(tags)} if tags else None)

    def reload_weights(self, weights_path: str) -> None:
        step = f"reload_weights({weights_path})"
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path},
                "timeout": None}
        answer = self._call(step, "POST", "/collective_rpc", body=body,
                            timeout_s=self.reload_timeout_s)
        if answer is not None and not (isinstance(answer, dict) and "results" in answer):
            raise WeightUpdateError(step, f"unexpected answer {str(answer)[:200]}")

    def reset_prefix_cache(self) -> None:
        """Retried while the server says blocks are still held (vLLM >= 0.26)."""
        for attempt in range(1, PREFIX_RESET_ATTEMPTS + 1):
            answer = self._call("POST /reset_prefix_cache", "POST", "/reset_prefix_cache")
            if answer is None or (isinstance(answer, dict) and answer.get("success") is True):
                return
            log.info("prefix cache not reset yet (attempt %d: %s): retrying", attempt, answer)
            self._pause(PREFIX_RESET_PAUSE_S)
        raise WeightUpdateError(
            "POST /reset_prefix_cache",
            f"still {{'success': false}} after {PREFIX_RESET_ATTEMPTS} attempts: requests "
            "hold cache blocks, so old-weight prefixes could be served")

    def load_weights(self, weights_path: str) -> None:
        """The whole phase-12 sequence on a sleeping server (see the module docstring)."""
        self.wake_up(["weights"])
        self.reload_weights(weights_path)
        self.wake_up(["kv_cache"])
        self.reset_prefix_cache()
        self._expect_sleeping("wake_up", False)

    def update_weights(self, weights_path: str) -> None:
        """A new checkpoint into an awake server, between requests (module docstring):
        a server left paused by a failure here is restarted by the caller."""
        self._call("POST /pause?mode=wait", "POST", "/pause", params={"mode": "wait"})
        self.reload_weights(weights_path)
        self.reset_prefix_cache()
        self._call("POST /resume", "POST", "/resume")
        answer = self._call("GET /is_paused", "GET", "/is_paused")
        if not (isinstance(answer, dict) and answer.get("is_paused") is False):
            raise WeightUpdateError("GET /is_paused", f"the server did not resume: {answer}")

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]],
                        dp_rank: int | None = None) -> list[list[float]]:
        """Each sequence's log-probabilities of tokens 1..n-1 as the server computes them."""
        body = {"model": self.client.model, "prompt": [list(s) for s in sequences],
                "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0.0}
        headers = {DP_RANK_HEADER: str(dp_rank)} if dp_rank is not None else None
        step = "probe completion" + (f" on data-parallel rank {dp_rank}" if headers else "")
        try:
            answer = self.client.request("POST", "/v1/completions", body, headers=headers)
        except ClientError as exc:
            raise self._unanswered(step, exc) from exc
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            out = [_prompt_part(c["logprobs"]["token_logprobs"], len(s))
                   for c, s in zip(choices, sequences, strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateError(step, f"no prompt log-probabilities in the answer "
                                    f"({type(exc).__name__}: {exc}): {str(answer)[:300]}") from None
        return out


def _prompt_part(token_logprobs: list[Any], length: int) -> list[float]:
    """Positions 1..length-1 (position 0 is null); finite floats or ValueError."""
    part = token_logprobs[1:length]
    if len(part) != length - 1 or not all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in part):
        raise ValueError(f"expected {length - 1} finite log-probabilities after a null")
    return [float(v) for v in part]
