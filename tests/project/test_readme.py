"""README.md's commands and config example must match the code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from coordinator.actions import resolve_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_the_demo_and_test_commands_and_ci_runs_the_latter() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"]
    assert "exec scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_cluster_example_in_the_readme_resolves_to_settings_for_a_real_model() -> None:
    from rl.config import parse_sections, requests_in_flight

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
