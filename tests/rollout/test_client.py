from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rollout.client import CompletionClient, GroupResult, ProtocolError, Sample, parse_choice

KEY = "test-key"


class FakeServer(ThreadingHTTPServer):
    """A real HTTP server speaking the completions protocol; behaviour by prompt.

    "ok:*"      answers after `delay_s`
    "flaky-K:*" answers 503 K times, then normally
    "down:*"    always 500
    "bad:*"     400
    "slow:*"    sleeps 2 s before answering
    "broken:*"  a choice without token_ids
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.delay_s = 0.0

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out closed its socket: expected in these tests

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":  # vLLM answers 200 with an empty body
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._send(401, {"error": {"message": "bad key"}})
            return
        prompt = body["prompt"]
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            srv.calls[prompt] += 1
            srv.bodies.append(body)
            calls = srv.calls[prompt]
        try:
            kind = prompt.split(":")[0]
            if kind == "slow":
                time.sleep(2.0)
            time.sleep(srv.delay_s)
            if kind.startswith("flaky-") and calls <= int(kind.split("-")[1]):
                self._send(503, {"error": {"message": "busy"}})
            elif kind == "down":
                self._send(500, {"error": {"message": "exploded"}})
            elif kind == "bad":
                self._send(400, {"error": {"message": "max_tokens too large"}})
            else:
                choices = []
                for j in range(body["n"]):
                    c = {
                        "index": j,
                        "text": f"{prompt}#{j}",
                        "finish_reason": "stop",
                        "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.5]},
                        "prompt_token_ids": [1, 2, 3],
                        "token_ids": [7, 2],
                    }
                    if kind == "broken":
                        del c["token_ids"]
                    choices.append(c)
                choices.reverse()  # the client must order by index
                self._send(200, {"choices": choices})
        finally:
            with srv.lock:
                srv.in_flight -= 1


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, s: float) -> None:
        self.calls.append(s)


def _err(group: GroupResult) -> str:
    assert group.error is not None, "expected a failed group"
    return group.error


def _client(srv: FakeServer, **kw: Any) -> CompletionClient:
    kw.setdefault("sleep", Sleeps())
    return CompletionClient(srv.url, KEY, **kw)


def test_groups_come_back_in_prompt_order_with_samples_in_index_order(server: FakeServer) -> None:
    res = _client(server, concurrency=4).generate_groups(
        [f"ok:{i}" for i in range(6)], n=3, max_tokens=2, seed=100
    )
    assert [g.prompt for g in res] == [f"ok:{i}" for i in range(6)]
    assert all(g.ok and g.attempts == 1 for g in res)
    assert [s.text for s in res[2].samples] == ["ok:2#0", "ok:2#1", "ok:2#2"]
    assert res[0].samples[0] == Sample(
        text="ok:0#0",
        prompt_token_ids=(1, 2, 3),
        token_ids=(7, 2),
        logprobs=(-0.5, -1.5),
        finish_reason="stop",
    )
    sent = {b["prompt"]: b for b in server.bodies}
    assert sent["ok:3"]["seed"] == 103 and sent["ok:3"]["return_token_ids"] is True
    assert sent["ok:3"]["logprobs"] == 0 and sent["ok:3"]["model"] == "policy"


def test_no_more_requests_than_the_concurrency_limit_are_in_flight(server: FakeServer) -> None:
    server.delay_s = 0.1
    res = _client(server, concurrency=3).generate_groups(
        [f"ok:{i}" for i in range(12)], n=1, max_tokens=1
    )
    assert all(g.ok for g in res)
    assert server.max_in_flight == 3


def test_single_requests_from_many_threads_share_the_same_limit(server: FakeServer) -> None:
    """Agent episodes (one thread each, more of them than requests in flight) call
    complete_one: the engine still sees at most `concurrency` requests at once."""
    server.delay_s = 0.1
    client = _client(server, concurrency=3, model="policy")
    answers: list[str] = []
    threads = [threading.Thread(target=lambda i=i: answers.append(
        client.complete_one(f"ok:{i}", n=1, max_tokens=1)[0].text)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)  # 4 rounds of 0.1 s when the limit holds
    assert sorted(answers) == sorted(f"ok:{i}#0" for i in range(12))
    assert server.max_in_flight == 3


def test_transient_errors_are_retried_with_exponential_backoff(server: FakeServer) -> None:
    sleeps = Sleeps()
    res = _client(server, retries=3, backoff_s=0.5, sleep=sleeps).generate_groups(
        ["flaky-2:x"], n=2, max_tokens=1
    )
    assert res[0].ok and res[0].attempts == 3 and len(res[0].samples) == 2
    assert sleeps.calls == [0.5, 1.0]


def test_a_request_that_keeps_failing_becomes_a_failed_group_with_its_error(
    server: FakeServer,
) -> None:
    sleeps = Sleeps()
    res = _client(server, retries=2, sleep=sleeps).generate_groups(
        ["ok:a", "down:b", "ok:c"], n=2, max_tokens=1
    )
    assert [g.ok for g in res] == [True, False, True]
    failed = res[1]
    assert failed.prompt == "down:b" and failed.samples == ()
    assert failed.attempts == 3 and server.calls["down:b"] == 3
    assert "HTTP 500" in _err(failed) and "exploded" in _err(failed)
    assert len(sleeps.calls) == 2


def test_a_rejected_request_is_not_retried(server: FakeServer) -> None:
    res = _client(server, retries=3).generate_groups(["bad:x"], n=1, max_tokens=1)
    assert not res[0].ok and res[0].attempts == 1
    assert "HttpError: HTTP 400" in _err(res[0])
    wrong_key = CompletionClient(server.url, "nope", retries=3, sleep=Sleeps())
    res = wrong_key.generate_groups(["ok:x"], n=1, max_tokens=1)
    assert "HTTP 401" in _err(res[0]) and res[0].attempts == 1


def test_a_request_slower_than_the_timeout_fails_after_its_retries(server: FakeServer) -> None:
    t0 = time.monotonic()
    res = _client(server, retries=1, request_timeout_s=0.3).generate_groups(
        ["slow:x", "ok:y"], n=1, max_tokens=1
    )
    assert time.monotonic() - t0 < 1.9  # two 0.3 s attempts, not the 2 s answer
    assert not res[0].ok and res[0].attempts == 2
    assert "within 0.3s" in _err(res[0])
    assert res[1].ok


def test_a_failing_health_check_ends_the_retries_with_its_message(server: FakeServer) -> None:
    def dead() -> None:
        raise RuntimeError("hf inference server pid 42 died: killed by SIGKILL (-9)")

    res = _client(server, retries=5, health_check=dead).generate_groups(
        ["down:x"], n=1, max_tokens=1
    )
    assert res[0].attempts == 1
    assert "killed by SIGKILL" in _err(res[0])


def test_the_health_check_names_the_cause_when_the_last_retry_fails(server: FakeServer) -> None:
    calls = []

    def dies_late() -> None:
        calls.append(1)
        if len(calls) == 3:  # fine while retrying, dead by the end
            raise RuntimeError("server pid 42 died: killed by SIGKILL (-9)")

    res = _client(server, retries=2, health_check=dies_late).generate_groups(
        ["down:x"], n=1, max_tokens=1
    )
    assert res[0].attempts == 3 and len(calls) == 3
    assert _err(res[0]) == "RuntimeError: server pid 42 died: killed by SIGKILL (-9)"


def test_health_accepts_an_empty_body_and_the_model_name_comes_from_the_server(
    server: FakeServer,
) -> None:
    client = _client(server)
    client.health()
    assert client.model == "policy"


def test_an_unreachable_server_gives_failed_groups_not_an_exception() -> None:
    client = CompletionClient("http://127.0.0.1:9", KEY, model="policy", retries=1, sleep=Sleeps())
    res = client.generate_groups(["ok:x"], n=1, max_tokens=1)
    assert not res[0].ok and "cannot reach" in _err(res[0])


def test_a_response_without_token_ids_is_a_protocol_error(server: FakeServer) -> None:
    res = _client(server, retries=3).generate_groups(["broken:x"], n=1, max_tokens=1)
    assert res[0].attempts == 1 and "ProtocolError" in _err(res[0])
    assert "return_token_ids" in _err(res[0])


@pytest.mark.parametrize(
    "choice",
    [
        {
            "text": "a",
            "finish_reason": "stop",
            "token_ids": [1],
            "prompt_token_ids": [1],
            "logprobs": {"token_logprobs": [-0.1, -0.2]},
        },
        {
            "text": "a",
            "finish_reason": "stop",
            "token_ids": [-1],
            "prompt_token_ids": [1],
            "logprobs": {"token_logprobs": [-0.1]},
        },
        {
            "text": "a",
            "finish_reason": "stop",
            "token_ids": [1],
            "prompt_token_ids": [1],
            "logprobs": {"token_logprobs": [None]},
        },
        {
            "text": "a",
            "finish_reason": "stop",
            "token_ids": [1],
            "prompt_token_ids": [1],
            "logprobs": {"token_logprobs": [0.7]},
        },
        {
            "text": 3,
            "finish_reason": "stop",
            "token_ids": [1],
            "prompt_token_ids": [1],
            "logprobs": {"token_logprobs": [-0.1]},
        },
    ],
)
def test_malformed_choices_are_rejected(choice: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        parse_choice(choice)


def test_invalid_client_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="concurrency=0 is below 1"):
        CompletionClient("http://x", KEY, concurrency=0)
    with pytest.raises(ValueError, match="retries=-1 is negative"):
        CompletionClient("http://x", KEY, retries=-1)


GOOD_CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "21"},
                          "finish_reason": "stop", "token_ids": [7, 2],
                          "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.1}]}}],
             "prompt_token_ids": [1, 5, 6]}


def test_a_chat_answer_gives_the_engines_prompt_and_response_ids() -> None:
    from rollout.wire import CHAT, parse_samples

    (sample,) = parse_samples(GOOD_CHAT, 1, CHAT)
    assert sample.prompt_token_ids == (1, 5, 6) and sample.token_ids == (7, 2)
    assert sample.logprobs == (-0.5, -0.1) and sample.text == "21"


@pytest.mark.parametrize(("change", "rule"), [
    ({"prompt_token_ids": None}, "prompt_token_ids is missing"),
    ({"choices": [{**GOOD_CHAT["choices"][0], "token_ids": None}]}, "token_ids is missing"),
    ({"choices": [{**GOOD_CHAT["choices"][0], "logprobs": None}]}, "logprobs.content has no"),
    ({"choices": [{**GOOD_CHAT["choices"][0], "message": "21"}]}, "lacks a message"),
    ({"choices": [{**GOOD_CHAT["choices"][0], "logprobs": {"content": [
        {"logprob": -0.5}, {"logprob": 0.5}]}}]}, "not a number <= 0"),
])
def test_malformed_chat_answers_are_rejected(change: dict[str, Any], rule: str) -> None:
    from rollout.wire import CHAT, parse_samples

    with pytest.raises(ProtocolError, match=rule):
        parse_samples({**GOOD_CHAT, **change}, 1, CHAT)


def test_a_cancel_while_a_group_is_awaited_ends_the_iteration_at_once(
        server: FakeServer) -> None:
    """A peer failing while this rank waits for a slow group: the daemon gives its main
    thread seconds to stop, so the wait must see the cancel, not the answer."""
    server.delay_s = 30.0
    cancelled = threading.Event()

    def check_cancel() -> None:
        if cancelled.is_set():
            raise InterruptedError("the group is stopping")

    groups = _client(server).iter_groups(["ok:0"], n=1, max_tokens=1,
                                         check_cancel=check_cancel)
    threading.Timer(0.3, cancelled.set).start()
    t0 = time.monotonic()
    with pytest.raises(InterruptedError, match="the group is stopping"):
        next(groups)
    assert time.monotonic() - t0 < 5.0  # not the 30 s answer
