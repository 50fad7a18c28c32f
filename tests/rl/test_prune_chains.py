"""Phase 13 keeps what a kept delta checkpoint is made from: its chain to the full base."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rl import layout
from tests.trainer.test_delta import publish, step, weights


def loop_of(tmp_path: Path, keep: int) -> Any:
    from coordinator.machine.actions import resolve_config
    from rl.loop import Loop

    config = resolve_config({"model": {"path": str(tmp_path / "model")},
                             "checkpoint": {"keep": keep},
                             "rollout": {"keep_rank_files": True}})
    return Loop(config, rank=0, num_nodes=1, run_dir=tmp_path / "run")


def present(run: Path) -> list[str]:
    return sorted(p.name for p in layout.checkpoints(run).iterdir())


def test_a_kept_deltas_parents_down_to_the_base_are_kept_then_pruned_with_it(
        tmp_path: Path) -> None:
    from rl.plan import prune

    run, last = tmp_path / "run", tmp_path / "last"
    share = layout.checkpoints(run)
    loop = loop_of(tmp_path, keep=2)
    w = weights()
    publish(share, 0, w, last)  # full: the base
    for i in (1, 2, 3):  # deltas, each of the one before
        w = step(w, 0.02, seed=i)
        assert publish(share, i, w, last, parent=i - 1).delta is not None
    prune(loop, SimpleNamespace(is_master=True, iteration=3))
    # keep=2 keeps iterations 2 and 3; 3 is a delta of 2, 2 of 1, 1 of 0: all stay.
    assert present(run) == [f"iter-00000{i}" for i in range(4)]
    w = step(w, 0.02, seed=4)
    assert publish(share, 4, w, last).delta is None  # a full one (checkpoint.full_every)
    w = step(w, 0.02, seed=5)
    assert publish(share, 5, w, last, parent=4).delta is not None
    prune(loop, SimpleNamespace(is_master=True, iteration=5))
    assert present(run) == ["iter-000004", "iter-000005"]  # the old chain went whole
