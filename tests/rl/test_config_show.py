"""`coordinator config`: the resolved configuration as TOML, each value with its source."""

from __future__ import annotations

import contextlib
import sys

from typer.testing import CliRunner

from coordinator.config.run_config import load_file
from coordinator.machine.actions import resolve_config
from coordinator_cli.app import app

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    err = ""
    with contextlib.suppress(ValueError):
        err = result.stderr
    return result.exit_code, result.stdout, err


def test_each_value_says_where_it_came_from_and_the_output_reads_back_the_same(tmp_path) -> None:
    config = tmp_path / "exp.toml"
    config.write_text('[train]\nlr = 1e-5\n[rollout]\ngroup_size = 4\n[run]\niterations = 9\n')
    args = ["config", "--config", str(config), "--set", "engine.max_model_len=128",
            "--set", "run.seed=2", "--iterations", "3"]
    code, out, err = invoke(*args)
    assert code == 0, err
    lines = out.splitlines()
    for line in ("iterations = 3  # --iterations", "seed = 2  # --set",
                 "lr = 1e-05  # file exp.toml", "group_size = 4  # file exp.toml",
                 "max_model_len = 128  # --set", "max_tokens = 6  # default (tiny model)",
                 "temperature = 1.0  # default", 'kind = "hf"  # default',
                 "# api_key = (none)  # default", "[coordination.phase_timeouts_s]"):
        assert line in lines, line
    # Read back as a config file, it resolves to what the file, --set and flags gave.
    printed = tomllib.loads(out)
    raw = load_file(config)
    raw["run"].update(iterations=3, seed=2)
    raw["engine"] = {"max_model_len": 128}
    assert resolve_config(printed).to_dict() == resolve_config(raw).to_dict()


def test_a_real_models_defaults_are_plain_defaults(tmp_path) -> None:
    code, out, err = invoke("config", "--model", str(tmp_path), "--set",
                            "engine.extra_args=--enforce-eager,--seed=1")
    assert code == 0, err
    assert f'path = "{tmp_path}"  # --model' in out
    assert "max_tokens = 1024  # default" in out.splitlines()
    assert 'extra_args = ["--enforce-eager", "--seed=1"]  # --set' in out


def test_a_bad_setting_exits_2_with_the_message_run_gives(tmp_path) -> None:
    for bad in ("rollout.group_size=1", "train.lrr=1", "engine.port=70000"):
        code, out, err = invoke("config", "--set", bad)
        assert code == 2 and out == "", (bad, out)
        run_code, _, run_err = invoke("run", "--master", "--run-dir", str(tmp_path / "r"),
                                      "--set", bad)
        assert run_code == 2 and err == run_err and err.startswith("error: "), (err, run_err)
