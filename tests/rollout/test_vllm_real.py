"""The project's vllm engine against a real `vllm serve`: vLLM's CPU build, the
version the `vllm` extra pins, installed in .venv-vllm by scripts/setup_vllm.sh.

One server serves the module (a start costs 30-90 s on 2 cores): every HTTP
call the project makes, parsed by its own code; sleep and an in-place reload of
a checkpoint published as the trainer publishes it, verified by probes (the
engine starts on `coordinator export`'s copy of the first one); a
refused reload of a corrupt checkpoint; then a restart-mode engine on the new
checkpoint, stopped leaving nothing behind; and vLLM's own errors reaching
EngineError in vLLM's words.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl.served_weights import verify_served_weights
from rollout.client import CompletionClient, HttpError
from rollout.conversation import Conversation
from rollout.engines.config import WeightUpdate
from rollout.engines.control import WeightUpdateError
from rollout.engines.engine import EngineConfig, EngineDied, EngineKind, EngineState, make_engine
from rollout.engines.vllm import VllmEngine
from trainer.checkpoint import publish_checkpoint
from trainer.probes import make_probe_set
from trainer.tiny_model import create_tiny_model

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
CPU_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20))


def config(**changes: object) -> EngineConfig:
    """The CPU build's settings on this machine: float32 (vLLM's bf16 CPU kernels
    use AMX, which this machine advertises and then kills with SIGILL), eager
    (compiling buys nothing for a tiny model), a KV cache of its own size (on CPU
    gpu_memory_utilization is a fraction of the node's RAM, shared with other
    processes), the tiny model's context."""
    base: dict[str, object] = dict(
        kind=EngineKind.VLLM, vllm_executable=str(VLLM), extra_args=CPU_ARGS, dtype="float32",
        max_model_len=128, ready_timeout_s=600, request_timeout_s=120, stop_grace_s=15)
    return EngineConfig(**{**base, **changes})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vllm_executable() -> Path:
    assert VLLM.exists(), (f"{VLLM} is missing: scripts/setup_test.sh installs vLLM's CPU build "
                           "there (scripts/setup_vllm.sh); the vllm engine's tests need it")
    return VLLM


def trainer_checkpoint(source: Path, out: Path) -> Path:
    """`source` published as the trainer publishes a checkpoint: manifest and probes."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    probes = make_probe_set(lambda ids: model(input_ids=ids).logits,
                            vocab_size=model.config.vocab_size, special_ids=[],
                            dtype="float32")
    publish_checkpoint(model, None, out, iteration=0, carry_files_from=source, probes=probes)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    first = trainer_checkpoint(create_tiny_model(root / "a", seed=1), root / "iter-a")
    second = trainer_checkpoint(create_tiny_model(root / "b", seed=2), root / "iter-b")
    return first, second


@pytest.fixture(scope="module")
def exported(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models[0] as `coordinator export` writes it (rl/export.py): a plain Hugging Face
    directory, no manifest.  The module's engine starts on it, so vLLM loading an
    export unchanged costs no engine start of its own."""
    from rl.export import Chosen, export

    out = tmp_path_factory.mktemp("export") / "policy"
    export(Chosen(iteration=0, path=models[0], why="the module's first model"), out,
           force=False)
    return out


@pytest.fixture(scope="module")
def engine(vllm_executable: Path, exported: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    made = make_engine(config(), log_dir=tmp_path_factory.mktemp("vllm-logs"))
    assert isinstance(made, VllmEngine)
    try:
        made.start(exported)
        yield made
    finally:
        made.close()


def client_of(engine: VllmEngine, key: str | None = None) -> CompletionClient:
    return CompletionClient(engine.base_url, key or engine.api_key, model="policy",
                            request_timeout_s=120, retries=0)


def test_vllm_reports_its_platform_and_the_command_asks_for_sleep_mode_only_where_it_has_one(
        engine: VllmEngine) -> None:
    platform = engine.platform()
    assert platform.asked and platform.device == "cpu" and not platform.sleep_mode
    assert platform.version == "0.29.0+cpu"
    assert "--enable-sleep-mode" not in engine.command(Path("/m"), 1)
    assert engine.state is EngineState.READY and engine.startup_s is not None


def test_vllm_serves_an_export_unchanged_with_the_checkpoints_weights(
        engine: VllmEngine, exported: Path, models: tuple[Path, Path]) -> None:
    """The engine started on `coordinator export`'s copy of models[0]: every file but the
    manifest, as published; served, its weights are the checkpoint's (the trainer's
    probes of models[0]), and its chat template renders a conversation."""
    assert engine.model_dir == exported
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        p.name for p in models[0].iterdir() if p.name != "manifest.json")
    verdict = verify_served_weights(engine.control(), engine.config, models[0], rank=0,
                                    host="here", previous=None)
    assert verdict.mean_abs_diff is not None
    assert verdict.mean_abs_diff <= (verdict.tolerance or 0.0)
    turn = Conversation(client_of(engine), [{"role": "user", "content": "12>"}]).generate(
        max_tokens=4, seed=3)
    assert turn.response_token_ids


def test_every_call_the_project_makes_is_answered_and_parsed_by_its_own_code(
        engine: VllmEngine, models: tuple[Path, Path]) -> None:
    client = client_of(engine)
    assert client.models() == ["policy"]
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    ids = tokenizer("12>")["input_ids"]
    # Completions: a text prompt and a token-id prompt, n samples each, with the
    # exact token ids and one log-prob per generated token.
    groups = client.generate_groups(["12>", ids], n=3, max_tokens=5, temperature=1.0,
                                    seeds=[1, 2])
    for group in groups:
        assert group.ok, group.error
        assert len(group.samples) == 3
        for sample in group.samples:
            assert list(sample.prompt_token_ids) == ids
            assert 1 <= len(sample.token_ids) == len(sample.logprobs) <= 5
            assert all(lp <= 0.0 for lp in sample.logprobs)
    # The same seed samples the same tokens.
    again = client.generate_groups(["12>"], n=3, max_tokens=5, temperature=1.0, seeds=[1])
    assert [s.token_ids for s in again[0].samples] == [s.token_ids for s in groups[0].samples]
    # /tokenize, as vLLM counts tokens, matches the model's tokenizer: text added to
    # a conversation (no special tokens) and chat messages through the template.
    assert client.tokenize_text("12>") == tokenizer("12>", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "12>"}]
    assert client.tokenize(messages, add_generation_prompt=True) == list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False))
    # Chat: the engine renders the template and returns the exact ids.
    conv = Conversation(client, [{"role": "user", "content": "12>"}])
    turn = conv.generate(max_tokens=4, seed=3)
    assert turn.response_token_ids and len(turn.response_token_ids) == len(
        turn.response_logprobs)
    assert list(turn.prompt_token_ids) == client.tokenize(messages, add_generation_prompt=True)
    # Echo probes: the trainer's prompt log-probs of the served weights.
    verdict = verify_served_weights(engine.control(), engine.config, models[0], rank=0,
                                    host="here", previous=None)
    assert verdict.probed and verdict.mean_abs_diff is not None
    assert verdict.mean_abs_diff <= (verdict.tolerance or 0.0)
    # The key guards /v1: a wrong one is refused, not retried.
    with pytest.raises(HttpError) as refused:
        client_of(engine, key="wrong").complete_one("12>", n=1, max_tokens=1)
    assert refused.value.status == 401


def test_a_prompt_too_long_for_the_context_is_refused_in_vllms_words(engine: VllmEngine) -> None:
    client = client_of(engine)
    with pytest.raises(HttpError) as info:
        client.complete_one("12>", n=1, max_tokens=200)
    assert info.value.status == 400
    assert "max_tokens=200 cannot be greater than max_model_len" in info.value.body


def test_sleep_then_an_in_place_reload_serves_the_published_checkpoint(
        engine: VllmEngine, models: tuple[Path, Path]) -> None:
    pid = engine.pid
    engine.sleep()
    assert engine.state is EngineState.SLEEPING and engine.control().is_sleeping()
    engine.load_weights(models[1])
    assert engine.state is EngineState.READY and engine.pid == pid  # the same process
    assert_serves(engine, models[1])
    # Awake, between requests (an asynchronous run's rollout node): vLLM's /pause
    # (mode wait), reload_weights, /reset_prefix_cache, /resume, the same process.
    engine.update_weights(models[0])
    assert engine.state is EngineState.READY and engine.pid == pid
    assert_serves(engine, models[0])


def assert_serves(engine: VllmEngine, model: Path) -> None:
    """The served weights match `model`'s probes, and the engine answers completions."""
    verdict = verify_served_weights(engine.control(), engine.config, model, rank=0,
                                    host="here", previous=None)
    assert verdict.mean_abs_diff is not None and verdict.tolerance is not None
    assert verdict.mean_abs_diff <= verdict.tolerance
    groups = client_of(engine).generate_groups(["34>"], n=2, max_tokens=3, seeds=[4])
    assert groups[0].ok, groups[0].error


def test_a_refused_reload_then_a_restart_on_the_new_checkpoint_leaves_nothing_behind(
        engine: VllmEngine, models: tuple[Path, Path], tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(models[0], corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    engine.sleep()
    with pytest.raises(WeightUpdateError):
        engine.load_weights(corrupt)
    # A failed reload may leave a mix of old and new weights: the engine is FAILED
    # and must not serve; the daemon restarts it instead (rl/engine_host.py).
    assert engine.state is EngineState.FAILED
    engine.stop()
    # Its own temporary directory, for vLLM's rendezvous file: what is left there is
    # this engine's, whatever the suite's other workers run.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    restart = make_engine(config(weight_update=WeightUpdate.RESTART, env=(("TMPDIR", str(tmp)),)),
                          log_dir=tmp_path / "logs")
    assert isinstance(restart, VllmEngine)
    try:
        restart.start(models[0])
        pids, port = restart.pids(), int(restart.base_url.rsplit(":", 1)[1])
        verdict = verify_served_weights(restart.control(), restart.config, models[0], rank=0,
                                        host="here", previous=None)
        assert verdict.mean_abs_diff is not None and verdict.tolerance is not None
        assert verdict.mean_abs_diff <= verdict.tolerance
    finally:
        restart.stop()
    assert restart.state is EngineState.STOPPED
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not list(tmp.glob("vllm_dist_*"))
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_a_flag_vllm_refuses_is_reported_in_vllms_own_words(
        vllm_executable: Path, models: tuple[Path, Path], tmp_path: Path) -> None:
    bad = make_engine(config(extra_args=(*CPU_ARGS, "--no-such-flag")), log_dir=tmp_path)
    with pytest.raises(EngineDied) as info:
        bad.start(models[0])
    assert info.value.cause == "vllm: error: unrecognized arguments: --no-such-flag"
    assert "it says: vllm: error: unrecognized arguments: --no-such-flag" in str(info.value)
    assert bad.state is EngineState.FAILED and bad.pid is None
