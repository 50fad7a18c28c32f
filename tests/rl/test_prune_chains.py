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


def test_a_killed_publishers_temporary_goes_at_the_phase_13_of_its_iteration(
        tmp_path: Path) -> None:
    """A trainer SIGKILLed while it publishes iteration 2 leaves its temporary
    directory in checkpoints/ (a whole model at real sizes); phase 13 of iteration 1
    leaves it (a publication of iteration 2 may be under way), phase 13 of iteration
    2 (the rerun published) removes it.  So does the FSDP2 staging directory."""
    import textwrap

    from rl.plan import _leftover, prune
    from tests.trainer.test_delta import ROOT, kill_at
    from trainer.sharded_save import staging_dir

    run, last = tmp_path / "run", tmp_path / "last"
    share = layout.checkpoints(run)
    loop = loop_of(tmp_path, keep=5)
    publish(share, 0, weights(), last)
    publish(share, 1, step(weights(), 0.02, seed=1), last, parent=0)
    gate = tmp_path / "sealing"
    kill_at(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        import trainer.checkpoint
        def killed_here(*args, **kwargs):  # every file written, before the rename
            Path({str(gate)!r}).write_text("sealing")
            time.sleep(60)
        trainer.checkpoint.seal_directory = killed_here
        from tests.trainer.test_delta import publish, weights
        publish(Path({str(share)!r}), 2, weights(seed=7), Path({str(tmp_path / "other")!r}))
    """), gate, "the publisher of iteration 2")
    (leftover,) = [p.name for p in share.iterdir() if p.name.startswith(".iter-000002.tmp-")]
    prune(loop, SimpleNamespace(is_master=True, iteration=1))
    assert leftover in [p.name for p in share.iterdir()]
    prune(loop, SimpleNamespace(is_master=True, iteration=2))
    assert present(run) == ["iter-000000", "iter-000001"]
    staging = staging_dir(layout.checkpoint(run, 2)).name
    assert _leftover(staging, 2) and not _leftover(staging, 1)
    assert not _leftover("iter-000002", 2) and not _leftover(".copy.lock", 2)
