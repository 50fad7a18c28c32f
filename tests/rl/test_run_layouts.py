"""The run-layout table: every layout reached by a placement, the loop asking its rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rl.placement import Placement
from rl.run_layouts import LAYOUTS, RunLayout, layout_of, markdown_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("rollout", "train", "k", "nodes", "expected"), [
    ("", "", 0, 3, RunLayout.COLOCATED),
    ("", "0", 0, 3, RunLayout.DISAGGREGATED),
    ("1-2", "0", 0, 3, RunLayout.DISAGGREGATED),
    ("0:4-7,1-2", "0:0-3", 0, 3, RunLayout.SPLIT_NODE),
    ("", "0", 1, 3, RunLayout.ASYNCHRONOUS),
    ("0:4-7", "0:0-3", 2, 1, RunLayout.ASYNCHRONOUS),  # one split node, asynchronous
])
def test_each_placement_gives_its_layout(rollout: str, train: str, k: int, nodes: int,
                                         expected: RunLayout) -> None:
    placement = Placement.of(rollout_nodes=rollout, train_nodes=train, max_off_policy_steps=k,
                             num_nodes=nodes)
    assert layout_of(placement) is expected


def test_every_layout_has_a_rule_and_a_row_and_only_colocated_shares_gpus() -> None:
    assert set(LAYOUTS) == set(RunLayout)
    table = markdown_table().splitlines()
    assert [row.split(" | ")[0].lstrip("| ") for row in table[2:]] == [x.value for x in RunLayout]
    assert [x for x, r in LAYOUTS.items() if r.shares_gpus] == [RunLayout.COLOCATED]
    assert [x for x, r in LAYOUTS.items() if r.rolls_out_ahead or r.off_policy] == \
        [RunLayout.ASYNCHRONOUS]


def test_the_loop_asks_the_table_instead_of_the_placements_booleans() -> None:
    """Outside rl/run_layouts.py and rl/placement.py (which defines them and checks a
    new run's placement) no module of rl/ reads whether the placement is colocated,
    asynchronous or has split nodes: it asks the layout's rule."""
    found = []
    for path in sorted((ROOT / "rl").glob("*.py")):
        if path.name in ("run_layouts.py", "placement.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in (
                    "colocated", "asynchronous", "split_nodes"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []
