from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch

from coordinator.errors import ExitCode, MalformedRecordError
from rollout.aggregate import aggregate_iteration
from rollout.batch_format import TRAIN_BATCH_VERSION, TrainBatch, TrainBatchError
from rollout.chunk_format import FinishReason, TrajectorySample, encode_chunk
from rollout.errors import AggregationError
from rollout.manifest import MANIFEST_NAME
from rollout.train_batch import TrainBatchWriter, load_train_batch, save_train_batch
from rollout.trajectory import RankCheckpointWriter


def tensors(**change: object) -> dict[str, object]:
    """A valid two-group batch as TrainBatch fields; `change` overrides some."""
    fields: dict[str, object] = {
        "iteration": 2,
        "group_size": 2,
        "group_task_ids": ("a", "b"),
        "group_index": torch.tensor([0, 0, 1, 1]),
        "prompt_tokens": torch.tensor([1, 1, 2, 2, 3], dtype=torch.int32),
        "prompt_offsets": torch.tensor([0, 1, 2, 4, 5]),
        "response_tokens": torch.tensor([5, 6, 7, 8], dtype=torch.int32),
        "response_offsets": torch.tensor([0, 2, 3, 3, 4]),
        "response_logprobs": torch.tensor([-1.0, -2.0, -0.5, -0.25]),
        "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
    }
    fields.update(change)
    return fields


def assert_same(a: TrainBatch, b: TrainBatch) -> None:
    assert (a.iteration, a.group_size, a.group_task_ids) == (
        b.iteration,
        b.group_size,
        b.group_task_ids,
    )
    for name in ("group_index", "prompt_tokens", "prompt_offsets", "response_tokens",
                 "response_offsets", "response_logprobs", "rewards"):  # fmt: skip
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_batch_round_trips_and_offers_the_trainers_list_views(tmp_path: Path) -> None:
    batch = TrainBatch(**tensors())  # type: ignore[arg-type]
    path = tmp_path / "out" / "batch.pt"
    save_train_batch(path, batch)
    loaded = load_train_batch(path)
    assert_same(loaded, batch)
    assert loaded.num_samples == 4 and loaded.num_groups == 2
    assert loaded.task_ids == ["a", "a", "b", "b"]
    assert loaded.prompt_ids == [[1], [1], [2, 2], [3]]
    assert loaded.response_ids == [[5, 6], [7], [], [8]]
    assert loaded.old_logprobs == [[-1.0, -2.0], [-0.5], [], [-0.25]]
    assert loaded.response_lengths.tolist() == [2, 1, 0, 1]
    raw = torch.load(path, weights_only=True)
    assert (raw["schema"], raw["version"]) == ("coordinator/train-batch", 3)
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["batch.pt"]  # no temp file left


def test_an_empty_batch_round_trips(tmp_path: Path) -> None:
    empty = TrainBatch(**tensors(  # type: ignore[arg-type]
        group_task_ids=(), group_index=torch.zeros(0, dtype=torch.int64),
        prompt_tokens=torch.zeros(0, dtype=torch.int32), prompt_offsets=torch.zeros(1, dtype=torch.int64),
        response_tokens=torch.zeros(0, dtype=torch.int32), response_offsets=torch.zeros(1, dtype=torch.int64),
        response_logprobs=torch.zeros(0), rewards=torch.zeros(0),
    ))  # fmt: skip
    save_train_batch(tmp_path / "b.pt", empty)
    loaded = load_train_batch(tmp_path / "b.pt")
    assert loaded.num_samples == 0 and loaded.num_groups == 0 and loaded.prompt_ids == []


def test_from_lists_builds_the_same_batch_as_the_flat_tensors() -> None:
    built = TrainBatch.from_lists(
        iteration=2, group_size=2, task_ids=["a", "a", "b", "b"],
        group_index=torch.tensor([0, 0, 1, 1]), prompt_ids=[[1], [1], [2, 2], [3]],
        response_ids=[[5, 6], [7], [], [8]], old_logprobs=[[-1.0, -2.0], [-0.5], [], [-0.25]],
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
    )  # fmt: skip
    assert_same(built, TrainBatch(**tensors()))  # type: ignore[arg-type]


def test_a_batch_written_in_pieces_equals_one_written_at_once(tmp_path: Path) -> None:
    batch = TrainBatch(**tensors())  # type: ignore[arg-type]
    layout = {name: getattr(batch, name) for name in
              ("group_index", "prompt_offsets", "response_offsets", "rewards")}  # fmt: skip
    target = tmp_path / "b.pt"
    with TrainBatchWriter(
        target, iteration=2, group_size=2, group_task_ids=("a", "b"), **layout
    ) as w:
        for first, end in ((0, 1), (1, 3), (3, 3), (3, 4)):
            p0, p1 = int(batch.prompt_offsets[first]), int(batch.prompt_offsets[end])
            r0, r1 = int(batch.response_offsets[first]), int(batch.response_offsets[end])
            w.append(
                samples=end - first,
                prompt_tokens=batch.prompt_tokens[p0:p1],
                response_tokens=batch.response_tokens[r0:r1],
                response_logprobs=batch.response_logprobs[r0:r1],
            )
            assert not target.exists()  # nothing visible before publish
        w.publish()
    assert_same(load_train_batch(target), batch)


def test_an_unfinished_writer_publishes_nothing_and_leaves_no_temp_file(tmp_path: Path) -> None:
    batch = TrainBatch(**tensors())  # type: ignore[arg-type]
    layout = {name: getattr(batch, name) for name in
              ("group_index", "prompt_offsets", "response_offsets", "rewards")}  # fmt: skip
    with TrainBatchWriter(tmp_path / "b.pt", iteration=2, group_size=2, group_task_ids=("a", "b"),
                          **layout) as writer:  # fmt: skip
        writer.append(samples=1, prompt_tokens=batch.prompt_tokens[:1],
                      response_tokens=batch.response_tokens[:2],
                      response_logprobs=batch.response_logprobs[:2])  # fmt: skip
        with pytest.raises(TrainBatchError, match=r"b\.pt: only 1 of 4 samples were written"):
            writer.publish()
        with pytest.raises(
            TrainBatchError, match=r"samples 1\..3: response_logprobs must be finite"
        ):
            writer.append(samples=3, prompt_tokens=batch.prompt_tokens[1:],
                          response_tokens=batch.response_tokens[2:],
                          response_logprobs=torch.tensor([float("nan"), 0.0]))  # fmt: skip
        with pytest.raises(
            TrainBatchError, match=r"prompt_tokens must be a 1-D torch\.int32 tensor of 4"
        ):
            writer.append(samples=3, prompt_tokens=batch.prompt_tokens[1:3],
                          response_tokens=batch.response_tokens[2:],
                          response_logprobs=batch.response_logprobs[2:])  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"iteration": -1}, r"iteration=-1 is not a valid integer"),
        ({"group_size": 0}, r"group_size=0 is not a valid integer"),
        (
            {"rewards": torch.tensor([1.0, 0.0, 0.0])},
            r"rewards must be a torch.float32 tensor of shape \(4,\)",
        ),
        (
            {"group_index": torch.tensor([0, 0, 1, 1], dtype=torch.int32)},
            "group_index must be a torch.int64",
        ),
        (
            {"prompt_tokens": torch.tensor([1, 1, 2, 2, 3])},
            "prompt_tokens must be a 1-D torch.int32",
        ),
        ({"prompt_offsets": torch.tensor([1, 1, 2, 4, 5])}, "prompt_offsets must start at 0"),
        ({"prompt_offsets": torch.tensor([0, 1, 1, 4, 5])}, r"prompt_offsets .*non-empty prompts"),
        ({"response_offsets": torch.tensor([0, 2, 1, 3, 4])}, r"response_offsets .*monotonic"),
        (
            {"response_offsets": torch.tensor([0, 2, 3, 3, 9])},
            "response_tokens must be a 1-D torch.int32 tensor of 9",
        ),
        (
            {"response_logprobs": torch.tensor([-1.0, float("nan"), 0.0, 0.0])},
            "response_logprobs must be finite",
        ),
        (
            {"response_tokens": torch.tensor([5, -6, 7, 8], dtype=torch.int32)},
            r"negative token id \(-6\)",
        ),
        ({"rewards": torch.tensor([1.0, float("inf"), 0.0, 1.0])}, "rewards must be finite"),
        ({"group_index": torch.tensor([0, 0, 2, 2])}, "count groups contiguously"),
        ({"group_index": torch.tensor([0, 1, 1, 1])}, r"every group must hold 2\.\.2 samples"),
        ({"group_task_ids": ("a", "a")}, "repeats a task"),
        ({"group_task_ids": ("a", "b", "c")}, "names 2 groups, group_task_ids 3"),
        ({"group_task_ids": ("a", "")}, "non-empty strings"),
    ],
)
def test_batches_violating_the_schema_are_refused_with_the_rule(change: dict, message: str) -> None:
    with pytest.raises(TrainBatchError, match=message):
        TrainBatch(**tensors(**change))  # type: ignore[arg-type]


def test_a_planted_custom_class_is_refused_without_running_its_code(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    payload = TrainBatch(**tensors()).to_payload()  # type: ignore[arg-type]
    payload["group_task_ids"] = [PlantedPayload(marker), "b"]
    torch.save(payload, tmp_path / "batch.pt")
    with pytest.raises(
        TrainBatchError, match=r"batch\.pt: was refused by torch.load\(weights_only=True\)"
    ):
        load_train_batch(tmp_path / "batch.pt")
    assert not marker.exists()
    torch.load(tmp_path / "batch.pt", weights_only=False)  # the plant really runs code
    assert marker.exists()


class PlantedPayload:
    """Unpickling this creates the marker file: code run by torch.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def saved(tmp_path: Path, obj: object) -> Path:
    path = tmp_path / "batch.pt"
    torch.save(obj, path)
    return path


def test_a_version_1_file_is_refused_with_a_way_out(tmp_path: Path) -> None:
    v1 = {"schema": "coordinator/train-batch", "version": 1, "iteration": 7, "prompt_ids": [[1]]}
    with pytest.raises(
        TrainBatchError,
        match=r"batch\.pt: has schema version 1 .* re-run the aggregation of iteration 7",
    ):
        load_train_batch(saved(tmp_path, v1))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda p: p.update(version=2),
            r"batch\.pt: has schema 'coordinator/train-batch' version 2: expected",
        ),
        (lambda p: p.pop("rewards"), r"batch\.pt: lacks fields \['rewards'\]"),
        (
            lambda p: p.update(response_offsets=torch.tensor([0, 2, 3, 3, 5])),
            r"batch\.pt: .*response_tokens must be",
        ),
    ],
)
def test_files_breaking_the_schema_are_refused_naming_the_file(
    tmp_path: Path, edit, message: str
) -> None:
    payload = TrainBatch(**tensors()).to_payload()  # type: ignore[arg-type]
    edit(payload)
    with pytest.raises(TrainBatchError, match=message) as caught:
        load_train_batch(saved(tmp_path, payload))
    assert caught.value.path == tmp_path / "batch.pt"


def test_a_truncated_or_non_dict_file_is_refused_and_a_missing_one_is_not_found(
    tmp_path: Path,
) -> None:
    save_train_batch(tmp_path / "good.pt", TrainBatch(**tensors()))  # type: ignore[arg-type]
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(TrainBatchError, match=r"cut\.pt: was refused by torch.load"):
        load_train_batch(tmp_path / "cut.pt")
    with pytest.raises(TrainBatchError, match=r"batch\.pt: is a list, not a dict"):
        load_train_batch(saved(tmp_path, [1, 2]))
    with pytest.raises(FileNotFoundError):
        load_train_batch(tmp_path / "absent.pt")


def test_a_batch_of_two_million_tokens_loads_in_well_under_a_few_seconds(tmp_path: Path) -> None:
    samples, prompt, response = 1024, 200, 2000  # 2.2M tokens; version 1 took ~5 s for this
    gen = torch.Generator().manual_seed(0)
    batch = TrainBatch(
        iteration=0, group_size=8, group_task_ids=tuple(f"t{g}" for g in range(samples // 8)),
        group_index=torch.arange(samples) // 8,
        prompt_tokens=torch.randint(0, 150_000, (samples * prompt,), dtype=torch.int32, generator=gen),
        prompt_offsets=torch.arange(samples + 1) * prompt,
        response_tokens=torch.randint(0, 150_000, (samples * response,), dtype=torch.int32, generator=gen),
        response_offsets=torch.arange(samples + 1) * response,
        response_logprobs=-torch.rand(samples * response, generator=gen),
        rewards=torch.rand(samples, generator=gen),
    )  # fmt: skip
    save_train_batch(tmp_path / "b.pt", batch)
    start = time.perf_counter()
    loaded = load_train_batch(tmp_path / "b.pt")
    load_s = time.perf_counter() - start
    views = (loaded.prompt_ids, loaded.response_ids, loaded.old_logprobs, loaded.task_ids)
    views_s = time.perf_counter() - start - load_s
    assert load_s < 3.0, f"loading took {load_s:.2f} s"
    assert views_s < 5.0, f"building list views took {views_s:.2f} s"
    assert len(views[1][-1]) == response and torch.equal(
        loaded.response_tokens, batch.response_tokens
    )


# --- the aggregation's streaming path -------------------------------------------------------


def group(task_id: str, *, failed: tuple[int, ...] = (), n: int = 3) -> list[TrajectorySample]:
    return [
        TrajectorySample(
            task_id=task_id, sample_index=i, prompt_token_ids=[7, len(task_id), i],
            response_token_ids=[] if i in failed else [100 + i] * (i + 1),
            response_logprobs=[] if i in failed else [-0.5 * (i + 1)] * (i + 1),
            response_text="", reward=float(i == 0), failed=i in failed,
            finish_reason=FinishReason.ERROR if i in failed else FinishReason.STOP,
            error="timeout" if i in failed else "",
        )
        for i in range(n)
    ]  # fmt: skip


def test_aggregation_cuts_failed_samples_out_of_the_middle_of_chunks(tmp_path: Path) -> None:
    writer = RankCheckpointWriter(tmp_path / "r0", 0, 3, iteration=0)
    # one chunk: keep all | drop sample 1 | drop the whole group (one survivor < 2)
    for task, failed in (("a", ()), ("bb", (1,)), ("ccc", (0, 2))):
        writer.add_group(group(task, failed=failed))
    writer.add_group(group("dddd", failed=(2,)))  # second chunk
    writer.finalize()
    out = tmp_path / "batch.pt"
    metrics = aggregate_iteration(
        {0: tmp_path / "r0"},
        {0: ["a", "bb", "ccc", "dddd"]},
        iteration=0,
        group_size=3,
        out_path=out,
    )
    batch = load_train_batch(out)
    assert metrics.num_train_samples == 7 and metrics.num_dropped_groups == 1
    assert batch.group_task_ids == ("a", "bb", "dddd")
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert batch.prompt_ids == [
        [7, 1, 0],
        [7, 1, 1],
        [7, 1, 2],
        [7, 2, 0],
        [7, 2, 2],
        [7, 4, 0],
        [7, 4, 1],
    ]
    assert batch.response_ids == [[100], [101] * 2, [102] * 3, [100], [102] * 3, [100], [101] * 2]
    assert batch.old_logprobs[4] == [-1.5] * 3 and batch.rewards.tolist() == [1, 0, 0, 1, 0, 1, 0]


def test_a_chunk_with_a_negative_token_id_fails_the_aggregation_naming_rank_and_file(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "r0"
    writer = RankCheckpointWriter(directory, 0, 1, iteration=0)
    writer.add_group(group("a"))
    writer.finalize()
    # Re-encode the chunk with a negative id (the writer refuses nothing of the kind),
    # and make the manifest vouch for it, as a buggy rank would.
    payload = encode_chunk([group("a")], rank=0, iteration=0)
    payload["response_tokens"][0] = -3
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (directory / "chunk-000000.pt").write_bytes(buffer.getvalue())
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["chunks"][0].update(sha256=hashlib.sha256(buffer.getvalue()).hexdigest(),
                                 size=len(buffer.getvalue()))  # fmt: skip
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(
        AggregationError,
        match=r"rank 0: chunk .*chunk-000000\.pt, samples 0\.\.2: .*negative token id \(-3\)",
    ):
        aggregate_iteration(
            {0: directory}, {0: ["a"]}, iteration=0, group_size=3, out_path=tmp_path / "b.pt"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0"]  # no batch, no temp file


def test_the_version_constant_is_the_one_written(tmp_path: Path) -> None:
    save_train_batch(tmp_path / "b.pt", TrainBatch(**tensors()))  # type: ignore[arg-type]
    assert torch.load(tmp_path / "b.pt", weights_only=True)["version"] == TRAIN_BATCH_VERSION


def test_train_batch_errors_are_coordinators_malformed_records(tmp_path: Path) -> None:
    with pytest.raises(MalformedRecordError) as in_memory:
        TrainBatch(**tensors(group_size=0))  # type: ignore[arg-type]
    assert isinstance(in_memory.value, TrainBatchError)
    assert in_memory.value.exit_code is ExitCode.CORRUPT and in_memory.value.path is None
    assert str(in_memory.value).startswith("train batch of iteration 2: group_size=0")
    with pytest.raises(MalformedRecordError) as on_disk:
        load_train_batch(saved(tmp_path, [1, 2]))
    assert isinstance(on_disk.value, TrainBatchError)
    assert on_disk.value.path == tmp_path / "batch.pt"
    assert str(on_disk.value) == f"{tmp_path / 'batch.pt'}: is a list, not a dict"
