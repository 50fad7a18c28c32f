"""The hf server's control endpoints: vLLM's development API for sleep mode and reloads.

`vllm serve` registers these routes only when VLLM_SERVER_DEV_MODE=1 (vLLM
0.29.0, entrypoints/launchers/api_server/routers.py), and sleep does anything
only with --enable-sleep-mode; the hf server follows both rules, so a daemon
that forgets either fails here exactly as it would on a GPU.  The shapes are
vLLM 0.29.0's, request for request:

    POST /sleep?level=1|2[&mode=abort|wait|keep]   200, empty body
    POST /wake_up[?tags=weights][&tags=kv_cache]     200, empty body
    GET  /is_sleeping                                {"is_sleeping": bool}
    POST /collective_rpc {"method": "reload_weights",
                          "kwargs": {"weights_path": DIR}}   {"results": [null]}
    POST /reset_prefix_cache                         {"success": true}
    POST /pause?mode=abort|wait|keep                 {"status": "paused"}
    POST /resume                                     {"status": "resumed"}
    GET  /is_paused                                  {"is_paused": bool}

Unlike vLLM (whose API key guards only /v1), the hf server asks for the key
on these routes too; the daemon sends it to both kinds.  Requests are served
one at a time, so a sleep waits for the completion in progress (vLLM's
mode=wait) whatever the mode; completions that arrive while asleep get 503.
A pause too waits for the completion in progress whatever the mode, and the
completions that arrive while paused wait for /resume (vLLM's mode=keep).

Faults for tests: when ROLLOUT_HF_FAULTS names a JSON file, the server reads
it at each reload and at startup:

    {"reload": "skip"}           answer reload_weights without loading anything
    {"reload": "unreadable"}     fail reload_weights as an unreadable shard does
    {"fail_start_from": N}       the N-th and later starts with this file exit 1
    {"completions": 400|500}     answer every completion request (text and chat)
                                 with this status, as a broken engine would

Starts are counted in FILE.starts (one line per start).  The daemon never
sets the variable; a test gives it to one node through engine.env.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

from rollout.hf.request import BadRequest
from rollout.hf.sampling import Generator
from rollout.hf.weights import WeightsError

log = logging.getLogger("rollout.hf.server")

DEV_MODE_ENV: Final = "VLLM_SERVER_DEV_MODE"
FAULTS_ENV: Final = "ROLLOUT_HF_FAULTS"
SLEEP_MODES: Final = ("abort", "wait", "keep")
WAKE_TAGS: Final = ("weights", "kv_cache", "scheduling")
ROUTES: Final = {
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
}


def dev_mode(environ: Mapping[str, str]) -> bool:
    """VLLM_SERVER_DEV_MODE as vLLM reads it: an integer, 0 when unset."""
    value = environ.get(DEV_MODE_ENV, "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{DEV_MODE_ENV}={value!r} is not an integer: vLLM reads it with int(); "
                         "set it to 1 to enable the development endpoints") from None


@dataclass(frozen=True)
class Faults:
    """Injected failures (see the module docstring); `path` is the file they came from."""

    path: Path
    reload: str | None = None
    fail_start_from: int | None = None
    completions: int | None = None

    @classmethod
    def load(cls, environ: Mapping[str, str]) -> Faults | None:
        name = environ.get(FAULTS_ENV)
        if not name:
            return None
        path = Path(name)
        try:
            spec = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{FAULTS_ENV}={name}: unreadable fault file: {exc}") from None
        reload, start = spec.get("reload"), spec.get("fail_start_from")
        completions = spec.get("completions")
        if reload not in (None, "skip", "unreadable") or not (
                start is None or (isinstance(start, int) and start >= 1)) or \
                completions not in (None, 400, 500):
            raise ValueError(f"{FAULTS_ENV}={name}: reload must be 'skip' or 'unreadable', "
                             "fail_start_from an integer >= 1 and completions 400 or 500, got "
                             f"{spec!r}")
        return cls(path=path, reload=reload, fail_start_from=start, completions=completions)

    def start_refused(self, pid: int) -> bool:
        """Count this start; True when the file says it must fail."""
        starts = self.path.with_name(self.path.name + ".starts")
        with starts.open("a") as f:
            f.write(f"{pid}\n")
        count = len(starts.read_text().splitlines())
        return self.fail_start_from is not None and count >= self.fail_start_from


class Control:
    """Answers the development routes for one Generator."""

    def __init__(self, generator: Generator, *, sleep_mode: bool,
                 faults: Faults | None = None) -> None:
        self.generator = generator
        self.sleep_mode = sleep_mode
        self.faults = faults

    def handle(self, method: str, path: str, query: dict[str, list[str]],
               body: Any) -> tuple[HTTPStatus, Any]:
        """(status, payload); payload None is an empty body.  BadRequest -> 400."""
        g = self.generator
        if (method, path) == ("GET", "/is_sleeping"):
            return HTTPStatus.OK, {"is_sleeping": g.is_sleeping()}
        if path == "/sleep":
            self._need_sleep_mode()
            level, mode = _one(query, "level", "1"), _one(query, "mode", "abort")
            if level not in ("1", "2") or mode not in SLEEP_MODES:
                raise BadRequest(f"level={level!r} must be 1 or 2 and mode={mode!r} one of "
                                 f"{SLEEP_MODES}")
            g.sleep(int(level))
            return HTTPStatus.OK, None
        if path == "/wake_up":
            self._need_sleep_mode()
            tags = query.get("tags")
            if tags is not None and not set(tags) <= set(WAKE_TAGS):
                raise BadRequest(f"tags={tags} are not among {WAKE_TAGS}")
            g.wake_up(tags)
            return HTTPStatus.OK, None
        if path == "/pause":
            mode = _one(query, "mode", "abort")
            if mode not in SLEEP_MODES:
                raise BadRequest(f"mode={mode!r} is not one of {SLEEP_MODES}")
            g.pause()
            return HTTPStatus.OK, {"status": "paused"}
        if path == "/resume":
            g.resume()
            return HTTPStatus.OK, {"status": "resumed"}
        if path == "/is_paused":
            return HTTPStatus.OK, {"is_paused": g.is_paused()}
        if path == "/reset_prefix_cache":
            # Every request is computed from scratch: there is no cache to reset.
            return HTTPStatus.OK, {"success": True}
        return self._rpc(body)

    def _need_sleep_mode(self) -> None:
        if not self.sleep_mode:
            raise BadRequest("sleep mode is off: start the server with --enable-sleep-mode")

    def _rpc(self, body: Any) -> tuple[HTTPStatus, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise BadRequest('collective_rpc needs a JSON object with a "method" string')
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if body["method"] != "reload_weights":
            raise BadRequest(f"method {body['method']!r} is not served by the hf server: it "
                             "answers reload_weights")
        if args or not isinstance(kwargs, dict) or set(kwargs) - {"weights_path"}:
            raise BadRequest("reload_weights takes only kwargs {\"weights_path\": DIR}")
        target = kwargs.get("weights_path")
        if target is not None and not isinstance(target, str):
            raise BadRequest(f"weights_path={target!r} is not a string")
        fault = self.faults.reload if self.faults is not None else None
        try:
            if fault == "unreadable":
                raise WeightsError(f"cannot read the weights of {target}: [Errno 5] "
                                   f"Input/output error (injected by {FAULTS_ENV})")
            if fault == "skip":
                log.warning("reload_weights(%s) skipped: injected by %s", target, FAULTS_ENV)
            else:
                self.generator.reload_weights(Path(target) if target else None)
        except WeightsError as exc:
            # vLLM answers a failed utility call with a 500 error JSON.
            log.error("reload_weights failed: %s", exc)
            return HTTPStatus.INTERNAL_SERVER_ERROR, _error(
                HTTPStatus.INTERNAL_SERVER_ERROR, f"Call to reload_weights method failed: {exc}")
        return HTTPStatus.OK, {"results": [None]}


def _one(query: dict[str, list[str]], name: str, default: str) -> str:
    values = query.get(name)
    return values[-1] if values else default


def _error(status: HTTPStatus, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": status.phrase, "code": int(status)}}


def faults_from_environment() -> Faults | None:
    return Faults.load(os.environ)
