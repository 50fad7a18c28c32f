from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from coordinator.errors import MalformedRecordError
from rollout.accumulator import BATCH_KEYS, AggregateMetrics
from rollout.aggregate import aggregate_iteration, merge_eval_metrics
from rollout.batch_format import TrainBatch, TrainBatchError
from rollout.chunk_format import FinishReason, TrajectorySample, encode_chunk
from rollout.errors import AggregationError, BudgetError
from rollout.manifest import MANIFEST_NAME, ChunkEntry, RankManifest, chunk_file_name
from rollout.sharding import ShardPlan
from rollout.train_batch import load_train_batch, save_train_batch
from rollout.trajectory import RankCheckpointWriter

# Damaged files are reported after the read deadline: 1 s here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("quick_read_retry")


def make_group(
    task_id: str, n: int = 2, *, failed: Sequence[int] = (), rewards: Sequence[float] = ()
) -> list[TrajectorySample]:
    out = []
    for i in range(n):
        bad = i in failed
        length = 2 + i
        out.append(
            TrajectorySample(
                task_id=task_id,
                sample_index=i,
                prompt_token_ids=[11, 12, 13 + i],
                response_token_ids=[] if bad else [200 + i] * length,
                response_logprobs=[] if bad else [-0.25 * (i + 1)] * length,
                response_text="" if bad else "text",
                reward=0.0 if bad else (rewards[i] if rewards else 1.0),
                finish_reason=FinishReason.ERROR if bad else FinishReason.LENGTH,
                failed=bad,
                error="timeout" if bad else "",
            )
        )
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_ranks(
    root: Path,
    plan: ShardPlan,
    *,
    group_size: int = 2,
    seconds: float = 2.0,
    skip: Sequence[str] = (),
) -> dict[int, Path]:
    dirs = {}
    for rank, task_ids in plan.as_mapping().items():
        clock = FakeClock()
        dirs[rank] = root / f"rank-{rank}"
        writer = RankCheckpointWriter(dirs[rank], rank, 2, iteration=plan.iteration, clock=clock)
        for task_id in task_ids:
            if task_id not in skip:
                writer.add_group(make_group(task_id, group_size))
        clock.now = seconds
        writer.finalize()
    return dirs


def write_raw_rank(
    directory: Path,
    rank: int,
    chunks: list[list[list[TrajectorySample]]],
    *,
    iteration: int = 0,
    complete: bool = True,
    tamper: Callable[[dict], None] | None = None,
) -> None:
    """A rank directory written by hand, to plant outputs the writer would refuse
    (`tamper` alters each chunk's payload before it is saved)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, groups in enumerate(chunks):
        buffer = io.BytesIO()
        payload = encode_chunk(groups, rank=rank, iteration=iteration)
        if tamper is not None:
            tamper(payload)
        torch.save(payload, buffer)
        data = buffer.getvalue()
        (directory / chunk_file_name(index)).write_bytes(data)
        entries.append(
            ChunkEntry(
                file=chunk_file_name(index),
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                num_samples=sum(len(g) for g in groups),
                task_ids=tuple(g[0].task_id for g in groups),
            )
        )
    manifest = RankManifest(
        rank=rank,
        iteration=iteration,
        complete=complete,
        rollout_seconds=1.0,
        chunks=tuple(entries),
    )
    (directory / MANIFEST_NAME).write_bytes(manifest.to_bytes())


def ids(n: int) -> list[str]:
    return [f"gsm8k/train/{i}" for i in range(n)]


def test_aggregation_publishes_a_batch_matching_the_rollouts_and_reports_metrics(
    tmp_path: Path,
) -> None:
    plan = ShardPlan.build(ids(9), [2.0, 1.0], seed=1, iteration=3)
    dirs = run_ranks(tmp_path, plan, group_size=2, seconds=4.0)
    out = tmp_path / "batch.pt"
    metrics = aggregate_iteration(dirs, plan.as_mapping(), iteration=3, group_size=2, out_path=out)
    batch = load_train_batch(out)
    assert batch.iteration == 3 and batch.group_size == 2
    assert batch.num_samples == 18 and batch.num_groups == 9
    assert sorted(set(batch.task_ids)) == sorted(ids(9))
    assert batch.group_index.tolist() == [g for g in range(9) for _ in range(2)]
    first = batch.task_ids.index("gsm8k/train/4")
    assert batch.prompt_ids[first : first + 2] == [[11, 12, 13], [11, 12, 14]]
    assert batch.response_ids[first + 1] == [201, 201, 201]
    assert batch.old_logprobs[first + 1] == [-0.5, -0.5, -0.5]
    assert batch.rewards.tolist() == [1.0] * 18
    assert metrics.num_samples == 18 and metrics.num_failed == 0 and metrics.num_tasks == 9
    assert metrics.reward_mean == 1.0 and metrics.reward_std == 0.0 and metrics.accuracy == 1.0
    assert metrics.response_length_mean == 2.5 and metrics.response_length_max == 3
    assert metrics.samples_per_second == {0: 12 / 4.0, 1: 6 / 4.0}
    assert json.loads(metrics.to_json())["samples_per_second"] == {"0": 3.0, "1": 1.5}


def test_failed_samples_are_left_out_and_groups_with_fewer_than_two_left_are_dropped(
    tmp_path: Path,
) -> None:
    groups = [
        make_group("a", 3, rewards=[1.0, 0.0, 0.5]),
        make_group("b", 3, failed=[1]),  # 2 remain: kept
        make_group("c", 3, failed=[0, 2]),  # 1 remains: dropped
    ]
    write_raw_rank(tmp_path / "r0", 0, [groups])
    out = tmp_path / "batch.pt"
    metrics = aggregate_iteration(
        {0: tmp_path / "r0"}, {0: ["a", "b", "c"]}, iteration=0, group_size=3, out_path=out
    )
    batch = load_train_batch(out)
    assert batch.task_ids == ["a", "a", "a", "b", "b"]
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, 1.0, 1.0]
    assert metrics.num_failed == 3 and metrics.num_train_samples == 5
    assert metrics.num_dropped_groups == 1
    good = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]  # c's surviving sample still counts in metrics
    assert metrics.reward_mean == pytest.approx(sum(good) / 6)
    mean = sum(good) / 6
    assert metrics.reward_std == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in good) / 6))
    assert metrics.accuracy == pytest.approx(4 / 6)


def test_incomplete_output_is_refused_naming_the_rank_and_the_missing_ids(tmp_path: Path) -> None:
    plan = ShardPlan.build(ids(40), [1, 1], seed=0, iteration=0)
    lost = list(plan.tasks_for(1)[:12])
    dirs = run_ranks(tmp_path, plan, skip=lost)
    with pytest.raises(AggregationError) as info:
        aggregate_iteration(
            dirs, plan.as_mapping(), iteration=0, group_size=2, out_path=tmp_path / "b.pt"
        )
    message = str(info.value)
    assert message.startswith("rank 1 output")
    assert "missing task ids: 12 (first 10: " in message
    assert sorted(lost)[0] in message and sorted(lost)[-1] not in message
    assert info.value.rank == 1 and info.value.missing == tuple(sorted(lost))
    assert not (tmp_path / "b.pt").exists()


def test_a_rank_without_a_manifest_is_missing_everything(tmp_path: Path) -> None:
    (tmp_path / "r1").mkdir()
    with pytest.raises(AggregationError, match=r"rank 1 left no manifest .* missing: 2 \("):
        merge_eval_metrics({1: tmp_path / "r1"}, {1: ["x", "y"]}, iteration=0, group_size=2)


def test_duplicated_ids_are_refused_naming_the_rank_and_the_ids(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a"), make_group("b")], [make_group("a")]])
    with pytest.raises(AggregationError, match=r"rank 0 .*duplicated task ids: 1 \(first 1: a\)"):
        aggregate_iteration(
            {0: tmp_path / "r0"},
            {0: ["a", "b"]},
            iteration=0,
            group_size=2,
            out_path=tmp_path / "b",
        )


def test_ids_foreign_to_the_rank_are_refused(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a"), make_group("b")]])
    write_raw_rank(tmp_path / "r1", 1, [[make_group("c")]])
    with pytest.raises(AggregationError, match=r"rank 0 .*foreign task ids: 1 \(first 1: b\)"):
        merge_eval_metrics(
            {0: tmp_path / "r0", 1: tmp_path / "r1"},
            {0: ["a"], 1: ["b", "c"]},
            iteration=0,
            group_size=2,
        )


def test_an_unfinalized_rank_is_refused(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a")]], complete=False)
    with pytest.raises(AggregationError, match=r"rank 0 manifest .* not marked complete"):
        merge_eval_metrics({0: tmp_path / "r0"}, {0: ["a"]}, iteration=0, group_size=2)


def test_a_manifest_from_another_iteration_is_refused(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a")]], iteration=4)
    with pytest.raises(AggregationError, match="rank 0 iteration 4, expected rank 0 iteration 5"):
        merge_eval_metrics({0: tmp_path / "r0"}, {0: ["a"]}, iteration=5, group_size=2)


def test_a_group_with_the_wrong_number_of_samples_is_refused(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 4), make_group("b", 3)]])
    with pytest.raises(AggregationError, match=r"without exactly 4 samples: 1 \(first 1: b\)"):
        merge_eval_metrics({0: tmp_path / "r0"}, {0: ["a", "b"]}, iteration=0, group_size=4)


def test_a_chunk_altered_after_its_manifest_is_refused_by_checksum(tmp_path: Path) -> None:
    plan = ShardPlan.build(ids(6), [1, 1], seed=0, iteration=0)
    dirs = run_ranks(tmp_path, plan)
    victim = dirs[1] / "chunk-000001.pt"
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(AggregationError, match=r"rank 1: .*chunk-000001\.pt: SHA-256 \S+ differs"):
        aggregate_iteration(
            dirs, plan.as_mapping(), iteration=0, group_size=2, out_path=tmp_path / "b.pt"
        )


class PlantedPayload:
    """Unpickling this opens (creates) the marker file: code run by torch.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def plant_hostile_chunk(directory: Path, marker: Path) -> Path:
    """Replace chunk 0 with one carrying a code-running object; fix the manifest to match."""
    payload = encode_chunk([make_group("a")], rank=0, iteration=0)
    payload["errors"] = [PlantedPayload(marker), ""]
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    path = directory / "chunk-000000.pt"
    path.write_bytes(data)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["chunks"][0].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def test_a_chunk_that_would_run_code_is_refused_even_with_a_matching_checksum(
    tmp_path: Path,
) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a")]])
    marker = tmp_path / "code-ran"
    planted = plant_hostile_chunk(tmp_path / "r0", marker)
    with pytest.raises(
        AggregationError,
        match=r"^rank 0: \S*/r0/chunk-000000\.pt: was refused by torch.load\(weights_only=True\)",
    ):
        aggregate_iteration(
            {0: tmp_path / "r0"}, {0: ["a"]}, iteration=0, group_size=2, out_path=tmp_path / "b"
        )
    assert not marker.exists()
    # The planted file really is hostile: an unguarded load runs its code.
    torch.load(planted, weights_only=False)
    assert marker.exists()


def test_loading_a_hostile_train_batch_is_refused_without_running_code(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "batch.pt"
    torch.save({"schema": "coordinator/train-batch", "x": PlantedPayload(marker)}, path)
    with pytest.raises(TrainBatchError, match=r"batch\.pt: was refused by torch.load"):
        load_train_batch(path)
    assert not marker.exists()


def valid_batch(**change: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "iteration": 2,
        "group_size": 2,
        "task_ids": ["a", "a", "b", "b"],
        "group_index": torch.tensor([0, 0, 1, 1]),
        "prompt_ids": [[1], [1], [2], [2]],
        "response_ids": [[5, 6], [7], [], [8]],
        "old_logprobs": [[-1.0, -2.0], [-0.5], [], [-0.1]],
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
    }
    fields.update(change)
    return fields


def test_train_batches_round_trip_through_the_exact_schema(tmp_path: Path) -> None:
    batch = TrainBatch.from_lists(**valid_batch())  # type: ignore[arg-type]
    save_train_batch(tmp_path / "b.pt", batch)
    raw = torch.load(tmp_path / "b.pt", weights_only=True)
    assert set(raw) == {
        "schema", "version", "iteration", "group_size", "group_task_ids", "group_index",
        "prompt_tokens", "prompt_offsets", "response_tokens", "response_offsets",
        "response_logprobs", "response_mask", "rewards",
    }  # fmt: skip
    assert (raw["schema"], raw["version"]) == ("coordinator/train-batch", 3)
    loaded = load_train_batch(tmp_path / "b.pt")
    assert loaded.task_ids == batch.task_ids and loaded.old_logprobs == batch.old_logprobs
    assert torch.equal(loaded.rewards, batch.rewards)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rewards": torch.tensor([1.0, 0.0, 0.0])}, "rewards must be a torch.float32 tensor"),
        ({"group_index": torch.tensor([0, 0, 2, 2])}, "count groups contiguously"),
        ({"old_logprobs": [[-1.0], [-0.5], [], [-0.1]]}, r"old_logprobs\[0\] must hold one float"),
        ({"prompt_ids": [[1], [1.5], [2], [2]]}, r"prompt_ids\[1\] must be a non-empty list"),
        ({"task_ids": ["a", "b", "b", "b"]}, "group 0 must be the samples of one task"),
        ({"group_index": torch.tensor([0, 1, 1, 1])}, r"every group must hold 2\.\.2 samples"),
        ({"group_size": 0}, "group_size=0 is not a valid integer"),
    ],
)
def test_train_batches_violating_the_schema_are_refused(change: dict, message: str) -> None:
    with pytest.raises(TrainBatchError, match=message):
        TrainBatch.from_lists(**valid_batch(**change))  # type: ignore[arg-type]


def test_a_train_batch_file_with_another_schema_version_is_refused(tmp_path: Path) -> None:
    payload = TrainBatch.from_lists(**valid_batch()).to_payload()  # type: ignore[arg-type]
    payload["version"] = 2  # before response_mask
    torch.save(payload, tmp_path / "b.pt")
    with pytest.raises(TrainBatchError, match="version 2: expected 'coordinator/train-batch'"):
        load_train_batch(tmp_path / "b.pt")


def test_eval_merging_reports_metrics_without_writing_a_batch(tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 2, rewards=[1.0, 0.0])]])
    write_raw_rank(tmp_path / "r1", 1, [[make_group("b", 2, failed=[0, 1])]])
    metrics = merge_eval_metrics(
        {0: tmp_path / "r0", 1: tmp_path / "r1"}, {0: ["a"], 1: ["b"]}, iteration=0, group_size=2
    )
    assert isinstance(metrics, AggregateMetrics)
    assert (metrics.num_samples, metrics.num_failed, metrics.accuracy) == (4, 2, 0.5)
    assert metrics.num_train_samples == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0", "r1"]
    # eval.json reports no batch's figures as 0: they are not in it.
    written = json.loads(metrics.to_json(batch=False))
    assert not written.keys() & set(BATCH_KEYS) and written["num_samples"] == 4
    assert set(BATCH_KEYS) <= json.loads(metrics.to_json()).keys()


def test_metrics_are_none_when_every_sample_failed_and_no_empty_batch_is_published(
        tmp_path: Path) -> None:
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 2, failed=[0, 1])]])
    metrics = merge_eval_metrics({0: tmp_path / "r0"}, {0: ["a"]}, iteration=0, group_size=2)
    assert metrics.reward_mean is None and metrics.accuracy is None
    assert json.loads(metrics.to_json())["reward_mean"] is None
    out = tmp_path / "b.pt"
    with pytest.raises(BudgetError, match="would hold 0 of the 2 samples"):
        aggregate_iteration({0: tmp_path / "r0"}, {0: ["a"]}, iteration=0, group_size=2,
                            out_path=out)
    assert not out.exists()


def test_the_merged_result_is_held_to_the_budget_before_anything_is_published(
        tmp_path: Path) -> None:
    # Two ranks, 8 samples: 3 failed (37%), each group keeps 2 or more answers.
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 4, failed=[0, 1])]])
    write_raw_rank(tmp_path / "r1", 1, [[make_group("b", 4, failed=[3])]])
    dirs, plan = {0: tmp_path / "r0", 1: tmp_path / "r1"}, {0: ["a"], 1: ["b"]}
    out = tmp_path / "b.pt"
    with pytest.raises(BudgetError, match=r"3 of 8 train \(all ranks\) samples failed "
                       r"\(limit rollout.max_failed_fraction=0.25\); first: "):
        aggregate_iteration(dirs, plan, iteration=0, group_size=4, out_path=out,
                            max_failed_fraction=0.25)
    with pytest.raises(BudgetError, match="3 of 8 eval"):
        merge_eval_metrics(dirs, plan, iteration=0, group_size=4, max_failed_fraction=0.25)
    # Within the failure budget, the 5 kept samples are below a minimum of 70 %.
    with pytest.raises(BudgetError, match=r"5 of the 8 samples .*min_batch_fraction=0.7"):
        aggregate_iteration(dirs, plan, iteration=0, group_size=4, out_path=out,
                            max_failed_fraction=0.5, min_batch_fraction=0.7)
    assert not out.exists()
    metrics = aggregate_iteration(dirs, plan, iteration=0, group_size=4, out_path=out,
                                  max_failed_fraction=0.5, min_batch_fraction=0.6)
    assert (metrics.num_failed, metrics.num_train_samples) == (3, 5)
    assert load_train_batch(out).num_samples == 5


def test_mismatched_rank_sets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AggregationError, match=r"ranks \[0\] but assignments for ranks \[0, 1\]"):
        merge_eval_metrics({0: tmp_path}, {0: ["a"], 1: ["b"]}, iteration=0, group_size=2)


def test_a_multi_turn_samples_loss_mask_reaches_the_batch_token_for_token(
        tmp_path: Path) -> None:
    # Episode: model tokens 200 201, then the environment's 7 8 9 (logprob 0, not
    # trained on), then the model's 202.
    mask = [1, 1, 0, 0, 0, 1]
    group = [TrajectorySample(
        task_id="t", sample_index=i, prompt_token_ids=[11, 12],
        response_token_ids=[200, 201, 7, 8, 9, 202], response_logprobs=[-0.5, -0.25, 0, 0, 0, -1],
        response_text="x", reward=float(i), finish_reason=FinishReason.STOP,
        response_mask=mask if i == 0 else None) for i in range(2)]
    write_raw_rank(tmp_path / "r0", 0, [[group]])
    out = tmp_path / "batch.pt"
    aggregate_iteration({0: tmp_path / "r0"}, {0: ["t"]}, iteration=0, group_size=2,
                        out_path=out)
    batch = load_train_batch(out)
    assert batch.response_masks == [[bool(m) for m in mask], [True] * 6]
    with pytest.raises(ValueError, match="one 0 or 1 per response token"):
        TrajectorySample(task_id="t", sample_index=0, prompt_token_ids=[1],
                         response_token_ids=[2, 3], response_logprobs=[-1, -1],
                         response_text="", reward=0.0, finish_reason=FinishReason.STOP,
                         response_mask=[1])


def test_each_batch_reports_its_policy_versions_and_refuses_samples_past_the_bound(
        tmp_path: Path) -> None:
    plan = ShardPlan.build(ids(4), [1.0, 1.0], seed=1, iteration=5)
    dirs = {}
    for rank, task_ids in plan.as_mapping().items():  # rank 0 one version behind
        dirs[rank] = tmp_path / f"rank-{rank}"
        writer = RankCheckpointWriter(dirs[rank], rank, 1, iteration=5, policy_version=4 + rank)
        for task_id in task_ids:
            writer.add_group(make_group(task_id))
        writer.finalize()
    metrics = aggregate_iteration(dirs, plan.as_mapping(), iteration=5, group_size=2,
                                  out_path=tmp_path / "batch.pt", oldest_version=4)
    per_rank = {r: 2 * len(t) for r, t in plan.as_mapping().items()}
    assert metrics.policy_versions == {4: per_rank[0], 5: per_rank[1]}
    assert metrics.staleness_max == 1 and metrics.staleness_mean == per_rank[0] / 8
    assert json.loads(metrics.to_json())["policy_versions"] == {"4": per_rank[0], "5": per_rank[1]}
    with pytest.raises(AggregationError, match="older than version 5"):
        aggregate_iteration(dirs, plan.as_mapping(), iteration=5, group_size=2,
                            out_path=tmp_path / "batch2.pt", oldest_version=5)


def test_staleness_is_of_the_batchs_samples_not_of_failed_or_dropped_ones(
        tmp_path: Path) -> None:
    """PROTOCOL: the staleness of a sample in iteration N's batch is N - version.  Rank 0's
    one group, on version 5, failed whole (dropped from the batch); rank 1's two groups,
    on version 6, are the batch: staleness 1 throughout, where counting every sample of
    the manifests gave a max of 2 and a mean of 1.33."""
    dirs = {}
    for rank, (version, groups) in enumerate(((5, [make_group("a", failed=(0, 1))]),
                                              (6, [make_group("b"), make_group("c")]))):
        dirs[rank] = tmp_path / f"rank-{rank}"
        writer = RankCheckpointWriter(dirs[rank], rank, 1, iteration=7, policy_version=version)
        for group in groups:
            writer.add_group(group)
        writer.finalize()
    metrics = aggregate_iteration(dirs, {0: ["a"], 1: ["b", "c"]}, iteration=7, group_size=2,
                                  out_path=tmp_path / "batch.pt")
    assert (metrics.num_train_samples, metrics.num_failed, metrics.num_dropped_groups) == (4, 2, 1)
    assert metrics.policy_versions == {6: 4}
    assert metrics.staleness_max == 1 and metrics.staleness_mean == 1.0


def test_phase_4_aggregates_only_the_manifest_whose_digest_phase_3_reported(
    tmp_path: Path,
) -> None:
    import dataclasses

    from coordinator.storage import fsio
    from rollout.aggregate import manifest_digest
    from rollout.manifest import read_manifest

    plan = ShardPlan.build(ids(6), [1, 1], seed=0, iteration=2)
    dirs = run_ranks(tmp_path, plan)
    reported: dict[int, str] = {}
    for rank, directory in dirs.items():  # what each rank reports at phase 3
        digest = manifest_digest(directory)
        assert digest is not None and len(digest) == 64
        reported[rank] = digest
    out = tmp_path / "batch.pt"
    aggregate_iteration(dirs, plan.as_mapping(), iteration=2, group_size=2, out_path=out,
                        manifest_sha256=reported)
    assert load_train_batch(out).num_samples == 12
    out.unlink()

    # A late writer (a rollout thread that outlived its phase) publishes rank 1's
    # manifest again, still valid, between phases 3 and 4.
    before = read_manifest(dirs[1])
    assert before is not None
    fsio.publish_bytes(dirs[1] / MANIFEST_NAME,
                       dataclasses.replace(before, rollout_seconds=99.0).to_bytes())
    now = manifest_digest(dirs[1])
    assert now != reported[1]
    with pytest.raises(AggregationError) as caught:
        aggregate_iteration(dirs, plan.as_mapping(), iteration=2, group_size=2, out_path=out,
                            manifest_sha256=reported)
    assert caught.value.rank == 1
    assert f"SHA-256 {now} now, but the rank reported {reported[1]} at phase 3" \
        in str(caught.value)
    assert not out.exists()  # nothing published from the changed manifest

    with pytest.raises(AggregationError, match=r"no manifest digest was reported at phase 3 "
                                               r"for rank\(s\) \[1\]"):
        aggregate_iteration(dirs, plan.as_mapping(), iteration=2, group_size=2, out_path=out,
                            manifest_sha256={0: reported[0]})
    assert not out.exists()


def test_reward_calls_and_timeouts_add_up_over_tries_and_ranks_into_the_metrics(
        tmp_path: Path) -> None:
    from rollout.reward_tally import RewardTally

    dirs = {0: tmp_path / "r0", 1: tmp_path / "r1"}
    # Rank 0 is killed after one group and restarted: the counts of both tries add up.
    first = RewardTally()
    writer = RankCheckpointWriter(dirs[0], 0, 1, iteration=0, rewards=first)
    for timed_out in (False, True, False):
        first.count(timed_out=timed_out)
    writer.add_group(make_group("a"))  # published with the counts so far
    again = RewardTally()
    writer = RankCheckpointWriter(dirs[0], 0, 1, iteration=0, rewards=again)
    assert writer.load_completed_task_ids() == {"a"}
    for timed_out in (True, False):
        again.count(timed_out=timed_out)
    writer.add_group(make_group("b"))
    writer.finalize()
    other = RewardTally()
    writer = RankCheckpointWriter(dirs[1], 1, 1, iteration=0, rewards=other)
    other.count(timed_out=False)
    writer.add_group(make_group("c"))
    writer.finalize()
    plan = {0: ["a", "b"], 1: ["c"]}
    metrics = aggregate_iteration(dirs, plan, iteration=0, group_size=2,
                                  out_path=tmp_path / "b.pt")
    assert (metrics.reward_calls, metrics.reward_timeouts) == (6, 2)
    assert json.loads(metrics.to_json())["reward_timeouts"] == 2
    evaluated = merge_eval_metrics(dirs, plan, iteration=0, group_size=2)
    assert (evaluated.reward_calls, evaluated.reward_timeouts) == (6, 2)


def test_the_merge_stops_as_soon_as_the_ranks_failures_sum_past_the_budget(
        tmp_path: Path) -> None:
    # 4 ranks x 4 samples at 25 %: 4 may fail.  Ranks 0 and 1 bring 5; rank 3's
    # output is missing, and never looked at.
    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 4, failed=[0, 1])]])
    write_raw_rank(tmp_path / "r1", 1, [[make_group("b", 4, failed=[0, 1, 2])]])
    write_raw_rank(tmp_path / "r2", 2, [[make_group("c", 4)]])
    dirs = {r: tmp_path / f"r{r}" for r in range(4)}
    plan = {0: ["a"], 1: ["b"], 2: ["c"], 3: ["d"]}
    for merge in (
            lambda: aggregate_iteration(dirs, plan, iteration=0, group_size=4,
                                        out_path=tmp_path / "b.pt", max_failed_fraction=0.25),
            lambda: merge_eval_metrics(dirs, plan, iteration=0, group_size=4,
                                       max_failed_fraction=0.25)):
        with pytest.raises(BudgetError, match=(
                r"5 of the first 8 (train|eval) \(all ranks\) samples failed: "
                r"rollout.max_failed_fraction=0.25 allows 4 of the phase's 16, so it stops "
                r"now instead of going through the other 8; first: timeout")):
            merge()
    assert not (tmp_path / "b.pt").exists()


def test_a_chunk_with_a_reward_that_is_no_number_is_refused_naming_it(tmp_path: Path) -> None:
    """NaN in a hostile or corrupt chunk: refused as the chunk's fault, where it went into
    the eval metrics (JSON refuses NaN: the merge's decision crashed, exit 1) or the batch
    (refused naming the batch, not the chunk)."""
    def nan_reward(payload: dict) -> None:
        payload["rewards"][0] = float("nan")

    write_raw_rank(tmp_path / "r0", 0, [[make_group("a", 2, rewards=[0.0, 1.0])]],
                   tamper=nan_reward)
    with pytest.raises((AggregationError, MalformedRecordError),
                       match=r"chunk-000000\.pt.*rewards must be finite"):
        merge_eval_metrics({0: tmp_path / "r0"}, {0: ["a"]}, iteration=0, group_size=2)
