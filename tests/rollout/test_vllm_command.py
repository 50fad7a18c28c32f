from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.engines.engine import EngineConfig, EngineKind, EngineStartError, make_engine
from rollout.engines.vllm import VllmEngine, build_vllm_command

# The values each flag gets; test_vllm_flags.py checks every flag against
# vLLM 0.29.0's own parser (a fixture extracted from its source).
SWITCHES = {"--enable-sleep-mode"}  # argparse BooleanOptionalAction: no value


def _flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs after `vllm serve MODEL` (a switch maps to "")."""
    out: dict[str, str] = {flag: "" for flag in argv[3:] if flag in SWITCHES}
    rest = [a for a in argv[3:] if a not in SWITCHES]
    assert len(rest) % 2 == 0, rest
    for flag, value in zip(rest[::2], rest[1::2], strict=True):
        assert flag.startswith("--") and not value.startswith("--"), (flag, value)
        assert flag not in out, f"{flag} given twice"
        out[flag] = value
    return out


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(kind=EngineKind.VLLM, **kw)


def test_command_starts_with_vllm_serve_and_the_model_directory_positionally() -> None:
    argv = build_vllm_command(_cfg(), Path("/models/step-7"), 8123, sleep_mode=True)
    assert argv[:3] == ["vllm", "serve", "/models/step-7"]


def test_every_flag_is_a_documented_vllm_serve_option_with_the_configured_value() -> None:
    cfg = _cfg(
        host="10.0.0.5",
        weight_update="restart",  # reload needs a loopback host: see the test below
        served_model_name="policy",
        tensor_parallel_size=2,
        data_parallel_size=3,
        gpu_memory_utilization=0.75,
        max_model_len=4096,
        dtype="bfloat16",
        seed=17,
    )
    flags = _flags(build_vllm_command(cfg, Path("/m"), 8123, sleep_mode=True))
    assert flags == {
        "--host": "10.0.0.5",
        "--port": "8123",
        "--served-model-name": "policy",
        "--tensor-parallel-size": "2",
        "--data-parallel-size": "3",
        "--gpu-memory-utilization": "0.75",
        "--max-model-len": "4096",
        "--dtype": "bfloat16",
        "--seed": "17",
        "--generation-config": "vllm",
    }
    assert _flags(build_vllm_command(_cfg(), Path("/m"), 1, sleep_mode=True))["--enable-sleep-mode"] == ""


def test_reload_refuses_a_host_other_nodes_can_reach() -> None:
    # vLLM's /sleep and /collective_rpc are not guarded by the API key.
    with pytest.raises(ValueError, match=r"weight_update='reload' with host='0.0.0.0'.*127\.0\.0\.1"):
        _cfg(host="0.0.0.0")
    assert _cfg(host="::1").host == "::1" and _cfg(host="localhost").host == "localhost"


def test_gpu_count_below_tp_times_dp_fails_before_the_server_starts(tmp_path: Path) -> None:
    engine = VllmEngine(_cfg(tensor_parallel_size=2, data_parallel_size=4), log_dir=tmp_path)
    engine.gpu_count = lambda env: 4  # type: ignore[method-assign]
    with pytest.raises(EngineStartError, match=r"tensor_parallel_size=2 x data_parallel_size=4 "
                       r"needs 8 GPUs but this node shows 4 \(NVML\): lower data_parallel_size "
                       r"to 2"):
        engine.start(_model_dir(tmp_path))
    assert engine.pid is None  # nothing was spawned


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return tmp_path / "m"


def test_max_model_len_is_left_to_the_model_when_not_configured() -> None:
    flags = _flags(build_vllm_command(_cfg(), Path("/m"), 1, sleep_mode=True))
    assert "--max-model-len" not in flags


def test_model_generation_config_is_ignored_unless_asked_for() -> None:
    assert _flags(build_vllm_command(_cfg(), Path("/m"), 1, sleep_mode=True))["--generation-config"] == "vllm"
    flags = _flags(build_vllm_command(_cfg(use_model_generation_config=True), Path("/m"), 1, sleep_mode=True))
    assert "--generation-config" not in flags


def test_extra_args_are_passed_through_verbatim_at_the_end() -> None:
    extra = ("--enforce-eager", "--max-num-seqs", "64")
    argv = build_vllm_command(
        _cfg(extra_args=extra, vllm_executable="/opt/venv/bin/vllm"), Path("/m"), 1,
        sleep_mode=True)
    assert argv[0] == "/opt/venv/bin/vllm"
    assert tuple(argv[-3:]) == extra


def test_api_key_travels_in_the_environment_not_on_the_command_line(tmp_path: Path) -> None:
    engine = VllmEngine(_cfg(api_key="s3cret"), log_dir=tmp_path)
    argv = engine.command(Path("/m"), 8000)
    assert "--api-key" not in argv and "s3cret" not in argv
    env = engine.environment("s3cret")
    assert env["VLLM_API_KEY"] == "s3cret"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_cuda_visible_devices_is_set_when_configured_and_inherited_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    inherited = VllmEngine(_cfg(), log_dir=tmp_path).environment("k")
    assert inherited["CUDA_VISIBLE_DEVICES"] == "3"
    pinned = VllmEngine(
        _cfg(cuda_visible_devices="0,1", tensor_parallel_size=2), log_dir=tmp_path
    ).environment("k")
    assert pinned["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_tensor_parallel_size_larger_than_the_visible_gpus_is_rejected() -> None:
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 x data_parallel_size=1 needs 4 GPUs but "
        r"cuda_visible_devices='0,1' shows 2",
    ):
        _cfg(tensor_parallel_size=4, cuda_visible_devices="0,1")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "fp8", r"dtype='fp8' is not one of"),
        ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization=1.5 is outside \(0, 1\]"),
        ("tensor_parallel_size", 0, r"tensor_parallel_size=0 is below 1"),
        ("port", 70000, r"port=70000 is outside 0..65535"),
        ("kind", "sglang", r"kind='sglang' is not one of: hf, vllm"),
    ],
)
def test_invalid_configuration_is_rejected_with_value_and_fix(field, value, message) -> None:
    kw = {"kind": EngineKind.VLLM, field: value}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_make_engine_builds_the_vllm_engine_without_importing_vllm(tmp_path: Path) -> None:
    assert isinstance(make_engine(_cfg(), log_dir=tmp_path), VllmEngine)
    code = (
        "import sys; from rollout.engines.engine import make_engine, EngineConfig; "
        "from pathlib import Path; "
        "make_engine(EngineConfig(kind='vllm'), log_dir=Path('.')); "
        "import rollout.engines.vllm, rollout.client; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def test_the_private_tmpdir_holds_vllms_socket_paths_under_a_deep_tmpdir(tmp_path: Path) -> None:
    """vLLM binds its ZMQ sockets at TMPDIR/<uuid4>; a Unix socket's path holds at most
    107 bytes (zmq refuses a longer one at the server's start).  A daemon's TMPDIR lies
    inside the run's node-local directory, often under a long scratch path: the private
    TMPDIR then goes to /tmp.  A short TMPDIR keeps it."""
    import shutil
    import tempfile
    import uuid

    from rollout.engines.vllm import SOCKET_PATH_MAX, private_tmp

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    shallow = Path(tempfile.mkdtemp(prefix="s-", dir="/tmp"))
    made: list[Path] = []
    try:
        moved, kept = private_tmp(str(deep)), private_tmp(str(shallow))
        made += [moved, kept]
        assert moved.parent == Path("/tmp") and moved.stat().st_mode & 0o777 == 0o700
        assert kept.parent == shallow
        for where in made:
            assert len(str(where / str(uuid.uuid4()))) <= SOCKET_PATH_MAX
    finally:
        for where in (*made, shallow):
            shutil.rmtree(where, ignore_errors=True)
