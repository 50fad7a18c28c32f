"""vLLM's sleep / wake_up / reload_weights / reset_prefix_cache sequence against the hf server.

The daemon's own client (rollout.engines.control.EngineControl) drives the hf
server's development routes, in process (fast), then the engine's lifecycle
through a real server subprocess, with the faults a test can inject.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.client import CompletionClient, HttpError, TransientError
from rollout.engines.control import EngineControl, WeightUpdateError
from rollout.engines.engine import EngineConfig, EngineKind, EngineState, make_engine
from rollout.hf.control import Control, Faults, dev_mode
from rollout.hf.server import Generator, Server
from trainer.probes import compare, make_probe_set, score
from trainer.tiny_model import create_tiny_model

KEY = "k"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return create_tiny_model(root / "a", seed=1), create_tiny_model(root / "b", seed=2)


def _probes(model_dir: Path):  # type: ignore[no-untyped-def]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return make_probe_set(lambda ids: model(input_ids=ids).logits,
                          vocab_size=model.config.vocab_size, special_ids=[], dtype="float32")


def _serve(model_dir: Path, *, sleep_mode: bool = True, dev: bool = True,
           faults: Faults | None = None) -> tuple[Server, str]:
    server = Server(("127.0.0.1", 0), api_key=KEY, model_name="policy")
    generator = Generator(model_dir, device="cpu", dtype="auto", max_batch=8, seed=0,
                          max_model_len=None)
    server.attach(generator, model_dir,
                  control=Control(generator, sleep_mode=sleep_mode, faults=faults) if dev else None)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def served(models: tuple[Path, Path]) -> Iterator[EngineControl]:
    server, url = _serve(models[0])
    yield EngineControl(CompletionClient(url, KEY, model="policy", retries=0),
                        reload_timeout_s=60)
    server.shutdown()
    server.server_close()


def _differs(control: EngineControl, model_dir: Path) -> float:
    probes = _probes(model_dir)
    served = control.prompt_logprobs([s.token_ids for s in probes.sequences])
    return compare(probes, served, 2e-3).mean_abs_diff


def test_echo_with_max_tokens_zero_gives_the_trainers_prompt_logprobs(
        served: EngineControl, models: tuple[Path, Path]) -> None:
    probes = _probes(models[0])
    answer = served.client.request("POST", "/v1/completions", {
        "prompt": [list(s.token_ids) for s in probes.sequences], "max_tokens": 0,
        "echo": True, "logprobs": 1})
    first = answer["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    assert len(first["tokens"]) == len(probes.sequences[0].token_ids)
    assert all(len(top) >= 1 for top in first["top_logprobs"][1:])
    assert _differs(served, models[0]) < 1e-4  # float32 on both sides: kernel order only
    assert _differs(served, models[1]) > 0.1  # another model is far outside the tolerance


def test_echo_with_generation_puts_the_prompt_first_in_text_and_logprobs(
        served: EngineControl) -> None:
    answer = served.client.request("POST", "/v1/completions", {
        "prompt": "12>", "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0,
        "return_token_ids": True})
    choice = answer["choices"][0]
    prompt_len, generated = len(choice["prompt_token_ids"]), len(choice["token_ids"])
    assert choice["text"].startswith("12>")
    assert len(choice["logprobs"]["token_logprobs"]) == prompt_len + generated
    with pytest.raises(HttpError, match=r"max_tokens=0 >= 1 \(0 only with echo\)"):
        served.client.request("POST", "/v1/completions", {"prompt": "1", "max_tokens": 0})


def test_sleep_wake_reload_sequence_serves_the_new_weights(
        served: EngineControl, models: tuple[Path, Path]) -> None:
    assert served.is_sleeping() is False
    served.sleep(2)
    assert served.is_sleeping() is True
    with pytest.raises(TransientError, match=r"503.*asleep"):  # no completions while asleep
        served.client.request("POST", "/v1/completions", {"prompt": "1", "max_tokens": 1})
    served.load_weights(str(models[1]))  # wake weights, reload, wake kv, reset, awake
    assert served.is_sleeping() is False
    assert _differs(served, models[1]) < 1e-4
    # Level 1 keeps a host copy: waking brings the same weights back.
    served.sleep(1)
    served.wake_up()
    assert _differs(served, models[1]) < 1e-4


def test_tied_embeddings_stay_tied_through_sleep_so_a_bf16_checkpoint_reloads(
        tmp_path: Path) -> None:
    # Qwen2.5-0.5B's lm_head is its embedding matrix, saved once in the checkpoint.
    from trainer.architectures import create_model, preset

    spec = preset("qwen2", "tiny", num_hidden_layers=1, tie_word_embeddings=True)
    first, second = (create_model(tmp_path / name, spec, seed=seed)
                     for name, seed in (("a", 1), ("b", 2)))
    server, url = _serve(first)
    control = EngineControl(CompletionClient(url, KEY, model="policy", retries=0),
                            reload_timeout_s=60)
    try:
        for level, reloaded in ((2, second), (1, first)):
            control.sleep(level)
            control.load_weights(str(reloaded))
            assert _differs(control, reloaded) < 1e-4, level
        model = server.generator.model  # type: ignore[union-attr]
        assert model.lm_head.weight is model.model.embed_tokens.weight
    finally:
        server.shutdown()
        server.server_close()


def test_an_awake_engine_is_updated_between_requests_and_a_paused_one_holds_them(
        served: EngineControl, models: tuple[Path, Path]) -> None:
    served.update_weights(str(models[1]))  # pause (wait), reload, reset, resume
    assert served.client.request("GET", "/is_paused") == {"is_paused": False}
    assert _differs(served, models[1]) < 1e-4
    # While paused a completion waits; it is answered once the engine resumes.
    served.client.request("POST", "/pause", None)
    answers: list[object] = []
    waiting = threading.Thread(target=lambda: answers.append(served.client.request(
        "POST", "/v1/completions", {"prompt": "1", "max_tokens": 1})))
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive() and not answers  # held, not refused
    served.client.request("POST", "/resume", None)
    waiting.join(timeout=30)
    assert len(answers) == 1


def test_a_reload_while_asleep_or_of_a_wrong_checkpoint_fails_naming_the_step(
        served: EngineControl, models: tuple[Path, Path], tmp_path: Path) -> None:
    served.sleep(2)
    with pytest.raises(WeightUpdateError, match=r"reload_weights.*wake_up \(tags weights\)"):
        served.reload_weights(str(models[1]))
    served.wake_up(["weights"])
    with pytest.raises(WeightUpdateError, match=r"reload_weights.*cannot read the weights") \
            as refused:
        served.reload_weights(str(tmp_path))  # no safetensors there
    assert "(a control request waits at most engine.request_timeout_s=" in str(refused.value)
    served.reload_weights(str(models[1]))  # the engine survived and still reloads
    assert _differs(served, models[1]) < 1e-4


def test_control_routes_need_dev_mode_sleep_mode_and_the_key(models: tuple[Path, Path]) -> None:
    server, url = _serve(models[0], dev=False)
    try:
        with pytest.raises(HttpError, match="404"):
            CompletionClient(url, KEY).request("POST", "/sleep", params={"level": 1})
    finally:
        server.shutdown()
        server.server_close()
    server, url = _serve(models[0], sleep_mode=False)
    try:
        with pytest.raises(HttpError, match="--enable-sleep-mode"):
            CompletionClient(url, KEY).request("POST", "/sleep", params={"level": 1})
        with pytest.raises(HttpError, match="401"):
            CompletionClient(url, "wrong").request("GET", "/is_sleeping")
    finally:
        server.shutdown()
        server.server_close()
    assert dev_mode({"VLLM_SERVER_DEV_MODE": "1"}) and not dev_mode({})
    with pytest.raises(ValueError, match="is not an integer"):
        dev_mode({"VLLM_SERVER_DEV_MODE": "true"})  # vLLM parses it with int()


def test_probe_scores_match_between_batched_and_single_sequences(models: tuple[Path, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    probes = _probes(models[0])
    seqs = [s.token_ids for s in probes.sequences]
    one = score(lambda ids: model(input_ids=ids).logits, seqs[:1])
    assert one[0] == pytest.approx(list(probes.sequences[0].logprobs), abs=1e-5)


# --- the engine's lifecycle, through a real server subprocess ---------------


def _engine(tmp_path: Path, faults: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    env: tuple[tuple[str, str], ...] = ()
    if faults is not None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / "faults.json"
        path.write_text(json.dumps(faults))
        env = (("ROLLOUT_HF_FAULTS", str(path)),)
    cfg = EngineConfig(kind=EngineKind.HF, ready_timeout_s=120, ready_poll_s=0.1,
                       stop_grace_s=5, threads=1, env=env)
    return make_engine(cfg, log_dir=tmp_path / "logs")


@pytest.mark.slow
def test_engine_sleeps_and_reloads_in_place_keeping_its_pid(
        tmp_path: Path, models: tuple[Path, Path]) -> None:
    engine = _engine(tmp_path)
    try:
        engine.start(models[0])
        pid = engine.pid
        assert "--enable-sleep-mode" in engine.command(models[0], 1)
        engine.sleep()
        assert engine.state is EngineState.SLEEPING and engine.control().is_sleeping()
        engine.load_weights(models[1])
        assert engine.state is EngineState.READY and engine.pid == pid
        assert _differs(engine.control(), models[1]) < 1e-4
    finally:
        engine.close()


@pytest.mark.slow
def test_injected_faults_skip_or_fail_the_reload(tmp_path: Path, models: tuple[Path, Path]) -> None:
    skip = _engine(tmp_path / "skip", {"reload": "skip"})
    try:
        skip.start(models[0])
        skip.sleep(1)  # level 1: the old weights come back, as a stale engine would serve
        skip.load_weights(models[1])  # "succeeds"
        assert _differs(skip.control(), models[1]) > 0.1  # ... but serves the old weights
    finally:
        skip.close()
    failing = _engine(tmp_path / "fail", {"reload": "unreadable"})
    try:
        failing.start(models[0])
        failing.sleep()
        with pytest.raises(WeightUpdateError, match=r"reload_weights.*Input/output error"):
            failing.load_weights(models[1])
        assert failing.state is EngineState.FAILED
        failing.stop()
        failing.start(models[1])  # the fallback: a restart serves the checkpoint
        assert _differs(failing.control(), models[1]) < 1e-4
    finally:
        failing.close()


def test_a_reload_of_another_shape_is_refused_before_any_tensor_changes(
        tmp_path: Path, models: tuple[Path, Path]) -> None:
    from rollout.hf.weights import ResidentModel, WeightsError
    from trainer.tiny_model import TinyModelSpec

    # Same tensor names, a wider MLP: the first tensors of the file still fit.
    wider = create_tiny_model(tmp_path / "wider", seed=3, spec=TinyModelSpec(
        intermediate_size=512))
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    resident = ResidentModel(model, device=torch.device("cpu"), torch=torch)
    with pytest.raises(WeightsError, match=r"mlp\.\w+\.weight has shape .*512"):
        resident.reload(wider)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing half-loaded


@pytest.mark.slow
def test_a_server_that_is_up_but_fails_every_completion_fails_its_start_at_once(
        tmp_path: Path, models: tuple[Path, Path]) -> None:
    from rollout.engines.engine import EngineStartError

    engine = _engine(tmp_path, {"completions": 500})  # ready_timeout_s=120
    started = time.monotonic()
    try:
        with pytest.raises(EngineStartError, match=r"is up \(/health answers\) but answered the "
                           r"readiness completion with HTTP 500 3 times in a row"):
            engine.start(models[0])
        assert engine.state is EngineState.FAILED and engine.pid is None  # nothing left behind
    finally:
        engine.close()
    # Three probes 0.1 s apart after the model loads, not the 120 s readiness deadline.
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_start_that_takes_a_while_says_what_it_waits_for(
        tmp_path: Path, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM start takes minutes on a large model: a line at most every
    READY_PROGRESS_S (30 s) names the pid, the time so far against
    ready_timeout_s, the last probe's error and the log.  Here every 0.2 s: the hf
    server takes seconds to import torch before it answers."""
    from rollout.engines import server

    monkeypatch.setattr(server, "READY_PROGRESS_S", 0.2)
    engine = _engine(tmp_path)
    try:
        with caplog.at_level("INFO", logger="rollout.engines.engine"):
            engine.start(models[0])
        pid = engine.pid
    finally:
        engine.close()
    lines = [r.getMessage() for r in caplog.records if "not serving yet" in r.getMessage()]
    assert lines, caplog.text
    assert f"hf server (pid {pid}) not serving yet after" in lines[0]
    assert "of ready_timeout_s=120 (last probe: " in lines[0] and "its log: " in lines[0]
