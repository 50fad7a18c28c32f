"""A small OpenAI-compatible completions server on transformers, for CPU nodes.

    python -m rollout.hf.server --model DIR --host H --port P --api-key K \
        [--served-model-name NAME] [--device cpu|cuda] [--max-batch N] [--seed S]

`--model -` starts a warm spare: it binds the port, imports torch and
transformers, then reads the model directory from one line of stdin.

Routes: GET /health (no key, like vLLM), GET /v1/models, POST /v1/completions
(Bearer key required, 401 otherwise).  The key may also come from the
environment variable ROLLOUT_API_KEY, which keeps it out of `ps`.  With
VLLM_SERVER_DEV_MODE=1, vLLM's development routes for sleep mode and weight
reloads too (control.py; /sleep and /wake_up need --enable-sleep-mode).

This module is the HTTP layer and the process; the request, the sampling
loop and the response format (vLLM's CompletionResponse) are in
sampling.py.  Startup is dominated by importing torch and transformers
(a few seconds).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from rollout.hf.chat import ChatRequest, tokenize_answer
from rollout.hf.control import FAULTS_ENV, Control, Faults, dev_mode
from rollout.hf.control import ROUTES as CONTROL_ROUTES
from rollout.hf.request import DTYPES, MAX_TOP_LOGPROBS, BadRequest, CompletionRequest
from rollout.hf.sampling import Asleep, Generator

__all__ = [
    "API_KEY_ENV",
    "DTYPES",
    "MAX_BODY_BYTES",
    "MAX_TOP_LOGPROBS",
    "BadRequest",
    "CompletionRequest",
    "Generator",
    "Handler",
    "Server",
    "import_runtime",
    "main",
    "parse_args",
]

log = logging.getLogger("rollout.hf.server")

API_KEY_ENV: Final = "ROLLOUT_API_KEY"
MAX_BODY_BYTES: Final = 4 * 1024 * 1024


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: Any) -> None:
        body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(
            status, {"error": {"message": message, "type": status.phrase, "code": int(status)}}
        )

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.server.api_key}"
        if hmac.compare_digest(got.encode(), want.encode()):
            return True
        self._error(
            HTTPStatus.UNAUTHORIZED, "missing or wrong API key: send 'Authorization: Bearer KEY'"
        )
        return False

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(HTTPStatus.OK, {})
        elif path == "/v1/models":
            if self._authorized():
                self._send(HTTPStatus.OK, self.server.models_answer())
        else:
            self._control("GET")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path not in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            self._control("POST")
            return
        if not self._authorized():
            return
        faults = self.server.faults
        if faults is not None and faults.completions is not None and path != "/tokenize":
            self._error(HTTPStatus(faults.completions), "every completion fails here "
                        f"(injected by {FAULTS_ENV}={faults.path})")
            return
        try:
            body = self._body(required=True)
            model = body.get("model") if isinstance(body, dict) else None
            if model not in (None, self.server.model_name):
                self._error(
                    HTTPStatus.NOT_FOUND,
                    f"model {model!r} does not exist: this server "
                    f"serves {self.server.model_name!r}",
                )
                return
            if path == "/tokenize":
                self._send(HTTPStatus.OK, self.server.generator.locked(
                    lambda g: tokenize_answer(g, body)))
                return
            if path == "/v1/chat/completions":
                chat = ChatRequest.from_json(body)
                name = self.server.model_name
                self._send(HTTPStatus.OK, self.server.generator.locked(
                    lambda g: chat.answer(g, name)))
                return
            req = CompletionRequest.from_json(body)
            choices = self.server.generator.complete(req)
        except BadRequest as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return
        except Asleep as e:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
            return
        except Exception as e:  # a server bug must answer 500, not hang the client
            log.exception("completion failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
            return
        self._send(HTTPStatus.OK, self.server.completion_answer(choices, req.n))

    def _body(self, *, required: bool) -> Any:
        length = int(self.headers.get("Content-Length", "0"))
        if not (0 if not required else 1) <= length <= MAX_BODY_BYTES:
            raise BadRequest(f"Content-Length={length} is outside 1..{MAX_BODY_BYTES}")
        if length == 0:
            return None
        try:
            return json.loads(self.rfile.read(length))
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None

    def _control(self, method: str) -> None:
        """vLLM's development routes (control.py), when dev mode registered them."""
        parts = urlsplit(self.path)
        control = self.server.control
        if control is None or (method, parts.path) not in CONTROL_ROUTES:
            self._error(HTTPStatus.NOT_FOUND, f"no route {method} {parts.path}")
            return
        if not self._authorized():
            return
        try:
            status, payload = control.handle(method, parts.path, parse_qs(parts.query),
                                             self._body(required=False))
        except BadRequest as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e))
            return
        except Exception as e:  # a server bug must answer 500, not hang the client
            log.exception("%s %s failed", method, parts.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
            return
        self._send(status, payload)


class Server(ThreadingHTTPServer):
    """Binds at construction (reserving the port); serves once a model is attached."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], *, api_key: str, model_name: str | None) -> None:
        super().__init__(addr, Handler)
        self.api_key = api_key
        self.model_name = model_name or ""
        self.generator: Generator
        self.model_dir: Path
        self.control: Control | None = None
        self.faults: Faults | None = None  # injected by tests (control.py)
        self.started = time.time()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            # The client gave up (its timeout) before the answer was ready.
            log.warning("client %s left before its answer: %s", client_address, exc)
        else:
            super().handle_error(request, client_address)

    def attach(self, generator: Generator, model_dir: Path, *,
               control: Control | None = None) -> None:
        self.generator = generator
        self.model_dir = model_dir
        self.model_name = self.model_name or str(model_dir)
        self.control = control

    def models_answer(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "owned_by": "rollout",
                    "created": int(self.started),
                    "root": str(self.model_dir),
                    "max_model_len": self.generator.max_model_len,
                }
            ],
        }

    def completion_answer(self, choices: list[dict[str, Any]], n: int) -> dict[str, Any]:
        n_prompt = sum(len(c.get("prompt_token_ids", [])) for c in choices[::n])
        n_out = sum(len(c.get("token_ids", [])) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rollout.hf.server", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument(
        "--model",
        required=True,
        help="model directory, or '-': start warm (imports done, port bound) and "
        "read the directory from one line of stdin",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"default: ${API_KEY_ENV}")
    p.add_argument("--served-model-name", default=None, help="default: the model path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False,
                   help="allow /sleep and /wake_up (routes registered with "
                   "VLLM_SERVER_DEV_MODE=1, as in vLLM)")
    args = p.parse_args(argv)
    try:
        args.dev_mode = dev_mode(os.environ)
        args.faults = Faults.load(os.environ)
    except ValueError as e:
        p.error(str(e))
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if not args.api_key:
        p.error(f"no API key: pass --api-key or set {API_KEY_ENV}")
    if args.max_batch < 1:
        p.error(f"--max-batch={args.max_batch} is below 1")
    if args.model != "-" and not _is_model_dir(Path(args.model)):
        p.error(f"--model {args.model} has no config.json: give a Hugging Face model directory")
    return args


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def import_runtime(threads: int) -> None:
    """The slow part of startup (seconds): torch, transformers and its modeling core."""
    import torch
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    if threads:
        torch.set_num_threads(threads)


class _Terminate(BaseException):
    """Raised by the SIGTERM handler to leave serve_forever in the main thread."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminate


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.monotonic()
    server = None
    try:
        # Bind first: the port is ours from now on, even while a spare waits.
        server = Server(
            (args.host, args.port), api_key=args.api_key, model_name=args.served_model_name
        )
        import_runtime(args.threads)
        model_dir = Path(args.model)
        if args.model == "-":
            log.info(
                "warm on port %d after %.2fs: waiting for a model directory on stdin",
                server.server_address[1],
                time.monotonic() - t0,
            )
            line = sys.stdin.readline().strip()
            if not line:
                log.info("stdin closed before a model directory came: exiting")
                return 0
            model_dir, t0 = Path(line), time.monotonic()
            if not _is_model_dir(model_dir):
                log.error("%s has no config.json: give a Hugging Face model directory", model_dir)
                return 2
        if args.faults is not None and args.faults.start_refused(os.getpid()):
            log.error("startup refused: fail_start_from=%d in %s (an injected fault)",
                      args.faults.fail_start_from, args.faults.path)
            return 1
        generator = Generator(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch=args.max_batch,
            seed=args.seed,
            max_model_len=args.max_model_len,
        )
        control = Control(generator, sleep_mode=args.enable_sleep_mode,
                          faults=args.faults) if args.dev_mode else None
        server.attach(generator, model_dir, control=control)
        server.faults = args.faults
        log.info(
            "serving %s as %r on http://%s:%s (loaded in %.2fs, pid %d)",
            model_dir,
            server.model_name,
            *server.server_address[:2],
            time.monotonic() - t0,
            os.getpid(),
        )
        server.serve_forever(poll_interval=0.2)
    except (_Terminate, KeyboardInterrupt):
        log.info("terminating on signal")
    finally:
        if server is not None:
            server.server_close()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (about a second with torch loaded): nothing is
    # left to save, and stop() waits for this exit on every RL iteration.
    os._exit(code)
