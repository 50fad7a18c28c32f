"""The hf engine against its real server subprocess, on tiny random models."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from coordinator.errors import Cancelled
from rollout.client import CompletionClient, GroupResult
from rollout.engines.engine import (
    EngineConfig,
    EngineDied,
    EngineKind,
    EngineStartError,
    EngineState,
    make_engine,
)
from rollout.engines.hf import HfEngine
from trainer.tiny_model import EOS_ID, SPECIAL_TOKENS, TINY_VOCAB, create_tiny_model

# Tests marked slow start real server processes: each imports torch and
# transformers afresh (seconds on a busy 2-core node).


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return create_tiny_model(root / "a", seed=1), create_tiny_model(root / "b", seed=2)


def _engine(tmp_path: Path, *, port: int = 0, prewarm: bool = False) -> HfEngine:
    cfg = EngineConfig(
        kind=EngineKind.HF,
        port=port,
        prewarm=prewarm,
        ready_timeout_s=120,
        ready_poll_s=0.1,
        stop_grace_s=5,
        threads=1,
    )
    engine = make_engine(cfg, log_dir=tmp_path / "logs", port_file=tmp_path / "engine.json")
    assert isinstance(engine, HfEngine)
    return engine


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[HfEngine]:
    eng = _engine(tmp_path)
    yield eng
    eng.close()


def _assert_no_process(pids: tuple[int, ...]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"pid {pid} still running"


def _texts(groups: list[GroupResult]) -> list[list[tuple[int, ...]]]:
    assert all(g.ok for g in groups), [g.error for g in groups]
    return [[s.token_ids for s in g.samples] for g in groups]


@pytest.mark.slow
def test_engine_serves_groups_with_exact_token_ids_and_policy_logprobs_then_stops_cleanly(
    engine: HfEngine, models: tuple[Path, Path], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine.start(models[0])
    assert engine.state is EngineState.READY
    record = json.loads((tmp_path / "engine.json").read_text())
    assert record["port"] == int(engine.base_url.rsplit(":", 1)[1]) and record["pid"] == engine.pid
    print(f"\nhf server startup: {engine.startup_s:.2f}s")

    client = CompletionClient(
        engine.base_url, engine.api_key, concurrency=2, health_check=engine.check_alive
    )
    prompts = ["4021>", "93>"]
    groups = client.generate_groups(prompts, n=4, max_tokens=8, temperature=1.0, seed=7)
    tok = AutoTokenizer.from_pretrained(models[0], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(models[0], local_files_only=True).eval()
    for prompt, group in zip(prompts, groups, strict=True):
        assert group.ok, group.error
        assert len(group.samples) == 4
        assert len({s.token_ids for s in group.samples}) > 1  # n independent samples
        for s in group.samples:
            assert list(s.prompt_token_ids) == tok(prompt)["input_ids"]
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 8
            assert s.finish_reason == ("stop" if s.token_ids[-1] == EOS_ID else "length")
            assert s.text == tok.decode(list(s.token_ids), skip_special_tokens=True)
            # The server's log-probs are the policy's: log_softmax of raw logits.
            ids = torch.tensor([list(s.prompt_token_ids) + list(s.token_ids)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            start = len(s.prompt_token_ids) - 1
            expected = [float(logp[start + k, t]) for k, t in enumerate(s.token_ids)]
            assert s.logprobs == pytest.approx(expected, abs=1e-4)

    # Same seed, same samples; the key is required.
    again = client.generate_groups(prompts, n=4, max_tokens=8, temperature=1.0, seed=7)
    assert _texts(again) == _texts(groups)
    bad = urllib.request.Request(
        engine.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=10)
    assert err.value.code == 401

    pids = engine.pids()
    assert engine.pid in pids
    engine.stop()
    assert engine.state is EngineState.STOPPED
    _assert_no_process(pids)
    assert not (tmp_path / "engine.json").exists()
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]


@pytest.mark.slow
def test_restart_on_another_model_directory_serves_the_new_weights_from_the_warm_spare(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    engine = _engine(tmp_path, prewarm=True)

    def sample() -> list[list[tuple[float, ...]]]:
        client = CompletionClient(engine.base_url, engine.api_key, concurrency=1)
        groups = client.generate_groups(["4021>", "55>"], n=3, max_tokens=6, seed=11)
        assert all(g.ok for g in groups), [g.error for g in groups]
        # Log-probs, not just tokens: a near-uniform random model can sample the
        # same tokens from different weights with the same seed.
        return [[s.logprobs for s in g.samples] for g in groups]

    try:
        engine.start(models[0])
        first_key, first_pids = engine.api_key, engine.pids()
        from_a = sample()
        engine.stop()
        _assert_no_process(first_pids)
        spare = engine.spare_pid
        assert spare is not None and spare not in first_pids

        engine.start(models[1])
        print(f"\nhf server restart from the spare: {engine.startup_s:.2f}s")
        assert engine.pid == spare
        assert engine.api_key != first_key  # a fresh key per server
        assert sample() != from_a
    finally:
        engine.close()
    assert engine.spare_pid is None
    assert psutil.Process().children(recursive=True) == []


@pytest.mark.slow
def test_server_killed_during_generation_is_reported_with_exit_status_and_log_tail(
    engine: HfEngine, models: tuple[Path, Path]
) -> None:
    engine.start(models[0])
    pid = engine.pid
    assert pid is not None
    client = CompletionClient(
        engine.base_url,
        engine.api_key,
        concurrency=1,
        retries=3,
        backoff_s=0.05,
        health_check=engine.check_alive,
    )
    results: list[GroupResult] = []
    # A long request: 512 rows x 120 tokens, in forward passes of max_batch
    # rows, takes seconds of server CPU.  The kill waits until the server has
    # spent 0.1 s of CPU on it, so it lands mid-generation however loaded
    # the machine is (a fixed sleep once let the whole request finish first).
    server = psutil.Process(pid)
    busy_before = sum(server.cpu_times()[:2])
    worker = threading.Thread(
        target=lambda: results.extend(
            client.generate_groups(["4021>"], n=512, max_tokens=120, seed=1)
        )
    )
    worker.start()
    deadline = time.monotonic() + 30
    while sum(server.cpu_times()[:2]) - busy_before < 0.1:
        assert time.monotonic() < deadline, "the server never started generating"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    worker.join(60)

    assert len(results) == 1 and not results[0].ok
    error = results[0].error or ""
    assert "EngineDied" in error and "killed by SIGKILL (-9)" in error
    with pytest.raises(EngineDied) as info:
        engine.check_alive()
    died = info.value
    assert died.returncode == -signal.SIGKILL and died.pid == pid
    assert "serving" in died.log_tail and "as 'policy'" in died.log_tail
    assert engine.state is EngineState.FAILED
    engine.stop()
    assert engine.state is EngineState.STOPPED


@pytest.mark.slow
def test_a_server_that_dies_while_starting_is_reported_with_its_traceback(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: probes are refused at once
        engine = _engine(tmp_path, port=taken.getsockname()[1])
        with pytest.raises(EngineDied) as info:
            engine.start(models[0])
    assert info.value.returncode == 1
    assert "Address already in use" in info.value.log_tail
    assert engine.state is EngineState.FAILED and engine.pid is None

    with pytest.raises(EngineStartError, match=r"has no config\.json"):
        engine.start(tmp_path)


@pytest.mark.slow
def test_a_start_the_caller_cancels_stops_its_server_at_the_next_probe(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """A node whose group fails while its engine loads (a vLLM start takes minutes)
    must not wait ready_timeout_s: before a fix the daemon's exit timer killed it
    mid-start and the master's 'failed the same way' verdict was never logged."""
    probes: list[tuple[int, ...]] = []
    stopping = threading.Event()
    stopping.set()  # the group stops while the server still loads

    def check_cancel() -> None:
        probes.append(engine.pids())
        if stopping.is_set():
            raise Cancelled("the group is stopping")

    cfg = EngineConfig(kind=EngineKind.HF, ready_timeout_s=120, ready_poll_s=0.1,
                       stop_grace_s=5, threads=1)
    engine = make_engine(cfg, log_dir=tmp_path / "logs", check_cancel=check_cancel)
    started = time.monotonic()
    with pytest.raises(Cancelled, match="the group is stopping"):
        engine.start(models[0])
    # One probe and a stop: well inside the 120 s a start may take.
    assert time.monotonic() - started < 30, probes
    assert len(probes) == 1 and probes[-1], probes  # its server was running then
    assert engine.state is EngineState.FAILED and engine.pid is None
    _assert_no_process(probes[-1])
    stopping.clear()
    engine.start(models[0])  # the engine is usable again: the next session starts it
    assert engine.state is EngineState.READY
    engine.close()


@pytest.mark.slow
def test_the_caller_learns_each_servers_pid_at_spawn_and_a_kill_then_ends_the_start(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """The daemon registers the server as its child the moment it is spawned, so a
    failure elsewhere kills one still loading: its start then ends at the next
    probe, naming the death, where before it ran on until ready, past the daemon's
    exit timer (coordination.cancel_grace_s), and the node exited instead of
    regrouping (tests/integration/test_broken_settings.py, reward-shrink)."""
    spawned: list[int] = []

    def killed_at_spawn(pid: int) -> None:
        spawned.append(pid)
        os.kill(pid, signal.SIGKILL)  # what Runtime.kill_children does on a failure

    cfg = EngineConfig(kind=EngineKind.HF, ready_timeout_s=120, ready_poll_s=0.1,
                       stop_grace_s=5, threads=1)
    engine = make_engine(cfg, log_dir=tmp_path / "logs", on_spawn=killed_at_spawn)
    started = time.monotonic()
    with pytest.raises(EngineDied):
        engine.start(models[0])
    assert time.monotonic() - started < 30  # a probe or two, not the 120 s a start may take
    assert engine.state is EngineState.FAILED and engine.pid is None
    _assert_no_process(tuple(spawned))
    engine = make_engine(cfg, log_dir=tmp_path / "logs", on_spawn=spawned.append)
    engine.start(models[0])
    assert engine.state is EngineState.READY and spawned[1:] == [engine.pid]
    engine.close()


# --- the server's protocol, in process (no subprocess: fast) -----------------


@pytest.fixture(scope="module")
def served(models: tuple[Path, Path]) -> Iterator[str]:
    from rollout.hf.server import Generator, Server

    server = Server(("127.0.0.1", 0), api_key="k", model_name="policy")
    server.attach(
        Generator(models[0], device="cpu", dtype="auto", max_batch=4, seed=0, max_model_len=None),
        models[0],
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _post(url: str, body: dict[str, object], key: str = "k") -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_choices_are_indexed_prompt_major_across_batches_like_vllm(served: str) -> None:
    # 3 prompts x n=3 = 9 rows, in batches of max_batch=4.
    status, body = _post(
        served,
        {
            "prompt": ["12>", "345>", "6>"],
            "n": 3,
            "max_tokens": 3,
            "seed": 5,
            "logprobs": 2,
            "return_token_ids": True,
        },
    )
    assert status == 200
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(9))
    lengths = [len(c["prompt_token_ids"]) for c in choices]
    assert lengths == [4] * 3 + [5] * 3 + [3] * 3  # <bos> + characters
    first = choices[0]["logprobs"]
    assert len(first["tokens"]) == len(first["token_logprobs"]) == len(choices[0]["token_ids"])
    assert all(len(top) >= 2 for top in first["top_logprobs"])
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_greedy_sampling_picks_the_most_likely_token_every_step(served: str) -> None:
    _, body = _post(
        served,
        {
            "prompt": "4021>",
            "n": 2,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        },
    )
    a, b = body["choices"]
    assert a["token_ids"] == b["token_ids"]
    for lp, top in zip(a["logprobs"]["token_logprobs"], a["logprobs"]["top_logprobs"], strict=True):
        assert lp == pytest.approx(max(top.values()))


def test_a_stop_string_ends_the_text_before_it_and_keeps_its_tokens(served: str) -> None:
    _, free = _post(
        served,
        {"prompt": "4021>", "n": 1, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
    )
    text = free["choices"][0]["text"]
    assert len(text) >= 3
    stop = text[2]  # a character greedy decoding is known to produce
    _, body = _post(
        served,
        {
            "prompt": "4021>",
            "n": 1,
            "max_tokens": 12,
            "temperature": 0,
            "stop": [stop],
            "return_token_ids": True,
        },
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]
    ids = choice["token_ids"]
    assert ids == free["choices"][0]["token_ids"][: len(ids)]

    def decode(t: list[int]) -> str:
        return "".join(TINY_VOCAB[i] for i in t if i >= len(SPECIAL_TOKENS))

    # Tokens run up to and including the one that completed the stop string.
    assert decode(ids).endswith(stop) and stop not in decode(ids[:-1])


def test_bad_requests_are_refused_with_the_rule_broken(served: str) -> None:
    status, body = _post(served, {"prompt": "1" * 120, "max_tokens": 20})
    assert status == 400 and "maximum context length of 128" in body["error"]["message"]
    status, body = _post(served, {"prompt": "1", "n": 0})
    assert status == 400 and "n=0" in body["error"]["message"]
    status, body = _post(served, {"prompt": "1", "model": "other"})
    assert status == 404 and "serves 'policy'" in body["error"]["message"]
    status, _ = _post(served, {"prompt": "1"}, key="wrong")
    assert status == 401
    with urllib.request.urlopen(served + "/health", timeout=10) as resp:  # no key needed
        assert resp.status == 200
    status, body = _post(served, {"prompt": "1", "max_tokens": 2})
    assert status == 200 and "token_ids" not in body["choices"][0]  # only when asked
