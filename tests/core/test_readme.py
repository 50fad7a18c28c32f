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


def test_the_config_example_in_the_readme_is_valid() -> None:
    block = re.search(r"```toml\n(.*?)```", README, re.S)
    assert block is not None
    config = resolve_config(tomllib.loads(block.group(1)))
    assert config.sections["engine"]["kind"] == "vllm"
    assert config.sections["torchrun"]["nproc_per_node"] == 8
