"""A shrink's takeover (rl/takeover.py): phase 0 of the resumed iteration freezes what
a lost rank saved and shares out the rest of its tasks among the members."""

from __future__ import annotations

from pathlib import Path

from coordinator.machine.actions import StepContext, resolve_config
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from rl import layout
from rl.layout import Split
from rl.loop import Loop
from rl.takeover import take_over_lost_tasks
from rollout.manifest import RankManifest
from rollout.sharding import ShardPlan
from rollout.trajectory import RankCheckpointWriter
from tests.rollout.test_trajectory import make_group


def test_a_lost_ranks_failed_samples_go_to_the_members_to_be_redone(tmp_path: Path) -> None:
    config = resolve_config({"run": {"actions": "rl"}})
    loop = Loop(config, rank=0, num_nodes=3, run_dir=tmp_path)
    try:
        plan = ShardPlan(iteration=0, seed=0, weights=(1.0, 1.0, 1.0),
                         assignments=(("t0", "t1"), ("t2", "t3"), ("a", "b", "c", "d")))
        path = layout.shard_plan(tmp_path, 0, Split.TRAIN)
        path.parent.mkdir(parents=True)
        path.write_bytes(plan.to_bytes())
        # Rank 2 saved two chunks, one holding a failed sample, and was lost before it
        # accepted its result (its manifest is not complete).
        writer = RankCheckpointWriter(layout.rank_dir(tmp_path, 0, Split.TRAIN, 2), 2, 2,
                                      iteration=0)
        for task, failed in (("a", ()), ("b", (0,)), ("c", ()), ("d", ())):
            writer.add_group(make_group(task, failed=failed))
        ctx = StepContext(rank=0, num_nodes=3, iteration=0, phase=Phase.SYNC, run_dir=tmp_path,
                          run_id="0123456789ab", config=config, weights=(1.0, 1.0, 1.0),
                          host="node-a", address="127.0.0.1", runtime=Runtime(),
                          members=(0, 1))

        assert take_over_lost_tasks(loop, ctx) == {"rerun": [1, 2, 3]}

        after = loop.find_shard_plan(0, Split.TRAIN)
        assert after is not None and after.frozen == (2,)
        assert after.assignments[2] == ("c", "d")
        taken = set(after.assignments[0] + after.assignments[1]) - {"t0", "t1", "t2", "t3"}
        assert taken == {"a", "b"}  # the failed sample's group is redone, with its chunk
        frozen = RankManifest.from_bytes(
            layout.frozen_manifest(tmp_path, 0, Split.TRAIN, 2).read_bytes(), path)
        assert frozen.complete and frozen.failed_samples == 0
    finally:
        loop.close()
