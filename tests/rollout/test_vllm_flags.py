"""The `vllm serve` command line we build, checked flag by flag against vLLM 0.29.0's parser.

rollout/engines/vllm.py never imports vllm, so a renamed flag, a value of the
wrong type or a --x/--no-x switch given a value would only show when a GPU
node starts the server.  fixtures/vllm_serve_0.29.0.json records what the
pinned release's `vllm serve` parser accepts; it is extracted from the wheel's
source by tests/support/vllm_flags/extract_vllm_flags.py, and the last tests re-run that
extraction when the unpacked wheel is on this machine.  To move to another
vLLM release: unpack its wheel, run the script into a new fixture, point
FIXTURE at it and change the pin in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rollout.engines.config import WeightUpdate
from rollout.engines.engine import EngineConfig, EngineKind
from rollout.engines.vllm import VllmEngine, build_vllm_command

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_serve_0.29.0.json"
EXTRACTOR = ROOT / "tests" / "support" / "vllm_flags" / "extract_vllm_flags.py"
WHEEL_SOURCE = Path("/tmp/vllm_wheels/src_v0.29.0/vllm")
WHEEL_HOWTO = (
    "cd /tmp && mkdir -p vllm_wheels && cd vllm_wheels && pip download vllm==0.29.0 "
    "--no-deps --only-binary :all: -d . && mkdir -p src_v0.29.0 && cd src_v0.29.0 && "
    "python -m zipfile -e ../vllm-0.29.0*.whl ."
)

# The development routes rollout/engines/control.py calls on a vLLM server.
CONTROL_ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
]

# The value types a fixture names, as parsers.
PARSE = {"int": int, "float": float, "str": str}

CONFIGS = {
    "default": {},
    "parallel-restart": {
        "tensor_parallel_size": 2,
        "data_parallel_size": 4,
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "weight_update": WeightUpdate.RESTART,
    },
    "model-generation-config": {"use_model_generation_config": True},
}


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return data


def _cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(kind=EngineKind.VLLM, **kw)


def _parse_argv(argv: list[str], fixture: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """`vllm serve MODEL --flag [value...] ...` -> {canonical flag: (option given, values)}.

    Each option is looked up in the fixture: a boolean_optional flag takes no
    value, a value flag exactly one unless its nargs is "+" (then one or more).
    """
    flags: dict[str, dict[str, Any]] = fixture["flags"]
    canonical = {option: name for name, spec in flags.items() for option in spec["option_strings"]}
    assert argv[1] == fixture["subcommand"]["name"] == "serve", argv
    assert not argv[2].startswith("-"), f"the model directory must come positionally: {argv}"
    parsed: dict[str, tuple[str, list[str]]] = {}
    i = 3
    while i < len(argv):
        option = argv[i]
        assert option in canonical, (
            f"{option} is not among the vLLM {fixture['vllm_version']} options in {FIXTURE.name} "
            f"({sorted(canonical)}): add it to FLAGS in tests/support/vllm_flags/extract_vllm_flags.py and "
            "regenerate the fixture, or fix rollout/engines/vllm.py"
        )
        name = canonical[option]
        assert name not in parsed, f"{name} given twice in {argv}"
        spec = flags[name]
        end = i + 1
        if spec["kind"] == "value":
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
            taken = end - i - 1
            wanted = "one or more values" if spec["nargs"] == "+" else "exactly one value"
            assert taken >= 1 and (spec["nargs"] == "+" or taken == 1), (
                f"{option} takes {wanted} in vLLM {fixture['vllm_version']} but got {argv[i + 1:end]}"
            )
        else:
            assert spec["kind"] == "boolean_optional", spec
        parsed[name] = (option, argv[i + 1:end])
        i = end
    return parsed


def _load_extractor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("extract_vllm_flags", EXTRACTOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- the fixture -----------------------------------------------------------


def test_fixture_is_from_the_release_pyproject_pins(fixture: dict[str, Any]) -> None:
    assert fixture["vllm_version"] == "0.29.0"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = project["optional-dependencies"]["vllm"]
    pins = [m.group(1) for r in requirements if (m := re.fullmatch(r"vllm\s*==\s*(\S+)", r))]
    assert pins == [fixture["vllm_version"]], (
        f"pyproject.toml's vllm extra is {requirements} but {FIXTURE.name} describes vLLM "
        f"{fixture['vllm_version']}: pin vllm=={fixture['vllm_version']}, or extract a fixture "
        "for the pinned release with tests/support/vllm_flags/extract_vllm_flags.py"
    )


def test_fixture_covers_the_serve_positional_and_every_flag_we_use(
    fixture: dict[str, Any],
) -> None:
    assert [p["name"] for p in fixture["positionals"]] == ["model_tag"]
    assert fixture["flags"]["--dtype"]["choices"] == sorted(
        ["auto", "half", "float16", "bfloat16", "float", "float32"]
    )
    assert fixture["flags"]["--enable-sleep-mode"]["kind"] == "boolean_optional"


# --- the command -----------------------------------------------------------


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_flag_is_a_vllm_option_given_a_value_it_accepts(
    fixture: dict[str, Any], overrides: dict[str, Any]
) -> None:
    argv = build_vllm_command(_cfg(**overrides), Path("/m"), 8123, sleep_mode=True)
    assert argv[2] == "/m"
    for name, (option, values) in _parse_argv(argv, fixture).items():
        spec = fixture["flags"][name]
        if spec["kind"] == "boolean_optional":
            assert option == name, f"{option}: we only ever switch {name} on"
            continue
        for value in values:
            try:
                PARSE[spec["type"]](value)
            except ValueError:
                pytest.fail(f"{option} {value!r}: vLLM parses it as {spec['type']}")
            if spec["choices"] is not None:
                assert value in spec["choices"], (
                    f"{option} {value!r} is not one of vLLM's choices {spec['choices']}"
                )


def test_sleep_mode_is_asked_for_only_to_reload_in_place_where_vllm_has_one(
    fixture: dict[str, Any],
) -> None:
    reload = _parse_argv(build_vllm_command(_cfg(), Path("/m"), 8123, sleep_mode=True), fixture)
    assert reload["--enable-sleep-mode"] == ("--enable-sleep-mode", [])
    # vLLM's CPU build refuses the flag ("Sleep mode is not supported on current
    # platform"): reload in place works there without it.
    cpu = _parse_argv(build_vllm_command(_cfg(), Path("/m"), 8123, sleep_mode=False), fixture)
    assert "--enable-sleep-mode" not in cpu
    for sleep_mode in (True, False):
        restart = _parse_argv(build_vllm_command(_cfg(weight_update=WeightUpdate.RESTART),
                                                 Path("/m"), 8123, sleep_mode=sleep_mode),
                              fixture)
        assert "--enable-sleep-mode" not in restart


@pytest.mark.parametrize("replicas", [1, 4])
def test_data_parallel_size_is_the_configured_replica_count(
    fixture: dict[str, Any], replicas: int
) -> None:
    argv = build_vllm_command(_cfg(data_parallel_size=replicas), Path("/m"), 8123, sleep_mode=True)
    assert _parse_argv(argv, fixture)["--data-parallel-size"][1] == [str(replicas)]


# --- the development routes ------------------------------------------------


def test_dev_mode_is_set_in_the_environment_only_for_reload(
    fixture: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_spec = fixture["dev_mode_env"]
    assert (env_spec["name"], env_spec["parse"]) == ("VLLM_SERVER_DEV_MODE", "int")
    monkeypatch.delenv(env_spec["name"], raising=False)
    reload = VllmEngine(_cfg(), log_dir=tmp_path).environment("k")
    assert reload[env_spec["name"]] == "1"
    assert bool(PARSE[env_spec["parse"]](reload[env_spec["name"]])), "vLLM would read it as off"
    restart = VllmEngine(_cfg(weight_update=WeightUpdate.RESTART), log_dir=tmp_path)
    assert env_spec["name"] not in restart.environment("k")


def test_the_routes_our_control_client_calls_are_vllm_dev_routes(
    fixture: dict[str, Any],
) -> None:
    routes = {(method, path) for method, path in fixture["dev_routes"]}
    missing = [route for route in CONTROL_ROUTES if route not in routes]
    assert not missing, f"vLLM {fixture['vllm_version']} has no dev route {missing}"


# --- the extractor ---------------------------------------------------------


def test_extractor_rejects_a_directory_that_is_not_the_vllm_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fixture.json"
    assert _load_extractor().main(["--source", str(tmp_path), "--out", str(out)]) == 1
    assert "is not the `vllm` package directory" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def wheel_source() -> Path:
    if not (WHEEL_SOURCE / "_version.py").is_file():
        pytest.skip(f"vLLM 0.29.0's unpacked wheel is not at {WHEEL_SOURCE}; make it with: "
                    f"{WHEEL_HOWTO}")
    return WHEEL_SOURCE


def test_extractor_reproduces_the_committed_fixture(
    wheel_source: Path, fixture: dict[str, Any]
) -> None:
    extracted = json.loads(json.dumps(_load_extractor().extract(wheel_source)))
    assert extracted == fixture, (
        f"{FIXTURE.name} is stale: regenerate it with python tests/support/vllm_flags/extract_vllm_flags.py "
        f"--source {wheel_source} --out {FIXTURE.relative_to(ROOT)}"
    )


def test_extractor_fails_naming_a_flag_vllm_does_not_have(wheel_source: Path) -> None:
    extractor = _load_extractor()
    with pytest.raises(extractor.ExtractError, match=r"--no-such-flag is not an option of `vllm serve`"):
        extractor.extract(wheel_source, flags=("--no-such-flag",))
