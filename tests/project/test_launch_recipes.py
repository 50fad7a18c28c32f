"""The launch recipes in examples/, run as far as this machine allows.

- examples/launch/slurm.sbatch runs under a real Slurm cluster
  (tests/project/test_slurm_recipe.py);
- examples/launch/skypilot.yaml's `run` section runs three times with
  SKYPILOT_NODE_RANK and SKYPILOT_NUM_NODES, as SkyPilot runs it per node,
  and SkyPilot's own parser (sky.Task.from_yaml, in .venv-sky) accepts it;
- examples/configs/qwen2.5-1.5b-gsm8k.toml and demo.toml load and validate;
  qwen2.5-7b-gsm8k.toml does too, with a reason beside each setting a 7 B run
  needs (its start-up checks run on a model of its shape in tests/rl/test_preflight.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import write_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"


def completed(run_dir: Path, ranks: int, iterations: int) -> bool:
    return all(json.loads((run_dir / "ranks" / str(r) / "journal.json").read_text())[
        "completed_iteration"] == iterations - 1 for r in range(ranks))


def recipe_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    config = write_config(tmp_path / "scripted.toml", iterations=3)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RUN_DIR": str(tmp_path / "run"),
            "CONFIG": str(config), "COORDINATOR": f"{sys.executable} -m coordinator_cli",
            "DOCTOR_TIMEOUT": "60", "RUN_ARGS": "", **extra}


def test_the_skypilot_run_section_runs_three_ranks_to_the_end(tmp_path: Path) -> None:
    task = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    assert task["num_nodes"] == 3 and "setup" in task
    base = recipe_env(tmp_path)
    procs = [subprocess.Popen(["bash", "-c", task["run"]], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**base, **{k: v for k, v in task["envs"].items()
                                              if k not in base},
                                   "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "3"})
             for rank in range(3)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], [o[-2000:] for o in outs]
    assert completed(tmp_path / "run", 3, 3)


def test_the_example_model_config_loads_and_validates() -> None:
    from coordinator.config.run_config import load_file
    from coordinator.machine.actions import resolve_config
    from rl.config import parse_sections

    config = resolve_config(load_file(ROOT / "examples/configs/qwen2.5-1.5b-gsm8k.toml"))
    s = parse_sections(config.sections)
    assert s.engine.kind.value == "vllm" and s.engine.data_parallel_size == 8
    assert s.torchrun.nproc_per_node == 8 and s.train.strategy.value == "fsdp2"
    assert s.data.path == "/shared/data/gsm8k" and s.rollout.group_size == 8
    assert config.coordination.lease_s == 30.0


# The settings a 7 B run needs, each with a comment saying why (on its line or
# the lines just above it).
SEVEN_B_KEYS: tuple[str, ...] = (
    "engine.dtype", "engine.tensor_parallel_size", "engine.data_parallel_size",
    "engine.gpu_memory_utilization", "engine.max_model_len", "engine.weight_update",
    "engine.sleep_level", "engine.ready_timeout_s", "train.strategy", "train.dtype",
    "train.param_dtype", "train.activation_checkpointing", "train.micro_batch_size",
    "train.mini_batch_size", "train.offload", "torchrun.nproc_per_node",
    "torchrun.wall_limit_s", "coordination.lease_s", "coordination.phase_timeouts_s.engine",
    "coordination.phase_timeouts_s.train")


def commented_keys(text: str) -> set[str]:
    """Dotted keys of a TOML file whose line has a comment or follows one."""
    found, table, previous = set(), "", ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            table = stripped.strip("[]")
        elif "=" in stripped and not stripped.startswith("#") and (
                "#" in stripped or previous.startswith("#")):
            found.add(f"{table}.{stripped.split('=')[0].strip()}")
        previous = stripped
    return found


def test_the_7b_recipe_gives_each_setting_a_7b_run_needs_with_its_reason() -> None:
    from coordinator.config.run_config import load_file
    from coordinator.machine.actions import resolve_config
    from rl.config import parse_sections

    recipe = ROOT / "examples/configs/qwen2.5-7b-gsm8k.toml"
    raw = load_file(recipe)
    config = resolve_config(raw)
    s, timeouts = parse_sections(config.sections), config.coordination.phase_timeouts_s
    assert s.engine.kind.value == "vllm" and s.engine.dtype == "bfloat16"
    assert s.train.dtype.value == "bfloat16" and s.train.strategy.value == "fsdp2"
    assert s.train.activation_checkpointing and s.train.micro_batch_size <= 8
    # Sleep mode: the engine stays up, asleep while the same GPUs train.
    assert s.engine.update.keeps_process and s.engine.sleep_level == 2
    assert s.engine.gpus == s.torchrun.nproc_per_node == 8
    assert s.engine.gpu_memory_utilization <= 0.7  # room for the offloaded trainer's residue
    # The component's own limit fires before the barrier's, with its own message.
    assert timeouts.engine > s.engine.ready_timeout_s >= 1200
    assert timeouts.train > s.torchrun.wall_limit_s
    assert s.model.path.startswith("/shared/") and s.data.path.startswith("/shared/")
    for key in SEVEN_B_KEYS:  # each one set in the file, not left to its default
        node: object = raw
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not set in {recipe}"
            node = node[part]
    missing = set(SEVEN_B_KEYS) - commented_keys(recipe.read_text())
    assert not missing, f"no comment saying why beside {sorted(missing)} in {recipe}"


def test_the_demo_settings_file_is_the_one_the_demo_runs_with() -> None:
    from coordinator.config.run_config import load_file
    from coordinator.machine.actions import resolve_config
    from rl.demo import demo_config

    assert demo_config() == ROOT / "examples/configs/demo.toml"
    config = resolve_config(load_file(demo_config()))
    assert config.run.actions == "rl" and config.coordination.lease_s == 10.0
    assert config.sections["model"]["path"] == ""  # the tiny model, built by the master


SKY = ROOT / ".venv-sky" / "bin" / "python"


def test_skypilots_own_parser_accepts_the_skypilot_recipe() -> None:
    assert SKY.exists(), f"{SKY} is missing: scripts/setup_test.sh installs SkyPilot there"
    read = ("import json, sys, sky\n"
            "t = sky.Task.from_yaml(sys.argv[1])\n"
            "r = next(iter(t.resources))\n"
            "print(json.dumps({'name': t.name, 'nodes': t.num_nodes, 'envs': t.envs,\n"
            "                  'accelerators': r.accelerators, 'setup': bool(t.setup),\n"
            "                  'run': bool(t.run), 'workdir': str(t.workdir)}))\n")
    done = subprocess.run([str(SKY), "-c", read, str(LAUNCH / "skypilot.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    task = json.loads(done.stdout.strip().splitlines()[-1])
    assert task["name"] == "coordinator-rl" and task["nodes"] == 3
    assert task["accelerators"] == {"H100": 8} and task["setup"] and task["run"]
    assert {"RUN_DIR", "CONFIG", "COORDINATOR"} <= set(task["envs"])
