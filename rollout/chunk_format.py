"""Rollout samples and the chunk files that store them, a few groups per file.

A chunk is a torch.save'd dict of tensors and plain containers only, so it
loads with weights_only=True.  Token ids and logprobs are stored flat
(int32/float32 tensors plus int64 offsets) rather than as lists of lists:
loading big tensors runs at disk speed, while unpickling millions of Python
ints under weights_only runs at about a million per second.

    encode_chunk(groups)          -> the payload RankCheckpointWriter saves
    read_verified_chunk(path, e)  -> size and SHA-256 checked against the
                                     manifest entry, loaded, decode_chunk'd
    decode_chunk(payload)         -> a validated Chunk, or MalformedRecordError
                                     naming the file

The writer that publishes chunks and the manifest naming them is in
rollout/trajectory.py.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from coordinator.errors import MalformedRecordError
from coordinator.storage.verified import read_verified
from rollout.manifest import ChunkEntry
from rollout.rewards import MAX_METRICS, METRIC_NAME, check_metrics
from rollout.tensor_files import load_tensors


class FinishReason(str, enum.Enum):
    """Why generation of a sample ended."""

    STOP = "stop"  # end-of-sequence or a stop string
    LENGTH = "length"  # hit max_tokens
    ABORT = "abort"  # the engine cancelled the request
    ERROR = "error"  # the sample failed; see TrajectorySample.error


@dataclass(frozen=True, kw_only=True)
class TrajectorySample:
    """One generated response to one task, with what the trainer needs from it.

    A failed sample (engine error, timeout) is recorded rather than dropped, so
    that its group still counts as done; `error` says what went wrong, and the
    aggregate leaves it out of the training batch.
    """

    task_id: str
    sample_index: int
    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    response_logprobs: Sequence[float]
    response_text: str
    reward: float
    finish_reason: FinishReason
    failed: bool = False
    error: str = ""
    # Per response token: 1 the model generated it (it is trained on), 0 it
    # came from the environment or the chat template between two model turns
    # of a multi-turn episode (its logprob is 0.0 and it is not trained on).
    # None: every response token is the model's.
    response_mask: Sequence[int] | None = None
    # The policy version the engine served when this sample was generated:
    # 0 the initial model, v the checkpoint trained through iteration v-1.
    policy_version: int = 0
    # The numbers its reward reported beside the score (a compute_score's dict),
    # averaged into the iteration's metrics as reward/<name>.
    reward_extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.policy_version) is not int or self.policy_version < 0:
            raise ValueError(f"policy_version={self.policy_version!r} of {self.task_id}: give "
                             "an integer >= 0")
        if not isinstance(self.task_id, str) or not self.task_id:
            raise ValueError(f"task_id={self.task_id!r}: give the task's non-empty id")
        if type(self.sample_index) is not int or self.sample_index < 0:
            raise ValueError(f"sample_index={self.sample_index!r}: give an integer >= 0")
        object.__setattr__(self, "finish_reason", FinishReason(self.finish_reason))
        for name in ("prompt_token_ids", "response_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list | tuple) or not all(type(t) is int for t in ids):
                raise ValueError(
                    f"{name} of {self.task_id}#{self.sample_index}: give a list of ints"
                )
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"{self.task_id}#{self.sample_index} has {len(self.response_token_ids)} response "
                f"tokens but {len(self.response_logprobs)} logprobs: give one logprob per token"
            )
        mask = self.response_mask
        if mask is not None and (len(mask) != len(self.response_token_ids)
                                 or not all(m in (0, 1) and type(m) is not float for m in mask)):
            raise ValueError(
                f"response_mask of {self.task_id}#{self.sample_index} must hold one 0 or 1 per "
                f"response token ({len(self.response_token_ids)})")
        if not isinstance(self.response_text, str):
            raise ValueError(f"response_text of {self.task_id}#{self.sample_index} is not a str")
        if isinstance(self.reward, bool) or not isinstance(self.reward, int | float):
            raise ValueError(f"reward={self.reward!r} of {self.task_id}: give a number")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward={self.reward!r} of {self.task_id}: give a finite number")
        check_metrics(self.reward_extra, where=f"reward_extra of {self.task_id}")
        if not isinstance(self.failed, bool) or not isinstance(self.error, str):
            raise ValueError("failed must be a bool and error a str")
        if self.failed != bool(self.error):
            raise ValueError(
                f"{self.task_id}#{self.sample_index}: failed={self.failed} with error="
                f"{self.error!r}: a failed sample needs an error message, a good one none"
            )


# --- Chunk files -------------------------------------------------------------

CHUNK_SCHEMA: Final = "coordinator/rollout-chunk"
CHUNK_VERSION: Final = 1
_TENSORS: Final = {  # name -> dtype; 1-D each
    "sample_group": torch.int64,
    "sample_index": torch.int64,
    "prompt_tokens": torch.int32,
    "prompt_offsets": torch.int64,
    "response_tokens": torch.int32,
    "response_offsets": torch.int64,
    "response_logprobs": torch.float32,
    "rewards": torch.float32,
    "failed": torch.bool,
}
# Read when present, else every response token is the model's (chunks written
# before multi-turn episodes).
_OPTIONAL_TENSORS: Final = {"response_mask": torch.bool}
# Per sample, read when present, else 0 (chunks written before policy versions).
_OPTIONAL_PER_SAMPLE: Final = {"policy_version": torch.int64}
# {name: float32 per sample, NaN where its reward did not report that name}, when
# any sample's reward reported numbers beside its score.  Names as
# rollout/rewards.py METRIC_NAME, at most this many in one chunk.
REWARD_EXTRA: Final = "reward_extra"
MAX_CHUNK_METRICS: Final = 4 * MAX_METRICS
_STRING_LISTS: Final = ("task_ids", "finish_reasons", "response_texts", "errors")


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """A decoded, validated chunk: groups of samples in flat tensors.

    Sample s belongs to group sample_group[s] (task task_ids[that]); its
    response tokens are response_tokens[response_offsets[s]:response_offsets[s+1]].
    """

    rank: int
    iteration: int
    task_ids: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    finish_reasons: tuple[str, ...]
    response_texts: tuple[str, ...]
    errors: tuple[str, ...]
    reward_extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.tensors["sample_group"].numel())

    def samples(self) -> Iterator[TrajectorySample]:
        """Samples back as records (slow; for inspection and tests)."""
        t = {k: v.tolist() for k, v in self.tensors.items()}
        extra = {k: v.tolist() for k, v in self.reward_extra.items()}
        po, ro = t["prompt_offsets"], t["response_offsets"]
        for s in range(self.num_samples):
            yield TrajectorySample(
                task_id=self.task_ids[t["sample_group"][s]],
                sample_index=t["sample_index"][s],
                prompt_token_ids=t["prompt_tokens"][po[s] : po[s + 1]],
                response_token_ids=t["response_tokens"][ro[s] : ro[s + 1]],
                response_logprobs=t["response_logprobs"][ro[s] : ro[s + 1]],
                response_text=self.response_texts[s],
                reward=t["rewards"][s],
                finish_reason=FinishReason(self.finish_reasons[s]),
                failed=t["failed"][s],
                error=self.errors[s],
                response_mask=_mask(t["response_mask"][ro[s] : ro[s + 1]]),
                policy_version=t["policy_version"][s],
                reward_extra={k: v[s] for k, v in extra.items() if not math.isnan(v[s])},
            )


def _mask(values: list[bool]) -> list[int] | None:
    return None if all(values) else [int(v) for v in values]


def encode_chunk(
    groups: Sequence[Sequence[TrajectorySample]], *, rank: int, iteration: int
) -> dict[str, Any]:
    """The torch.save payload for these groups: tensors and plain containers only."""
    samples = [s for g in groups for s in g]

    def offsets(lengths: list[int]) -> torch.Tensor:
        out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        return out

    def flat(rows: list[Sequence[Any]], dtype: torch.dtype) -> torch.Tensor:
        values = [v for row in rows for v in row]
        return torch.tensor(values, dtype=dtype)

    try:
        prompt_tokens = flat([s.prompt_token_ids for s in samples], torch.int32)
        response_tokens = flat([s.response_token_ids for s in samples], torch.int32)
    except RuntimeError as exc:  # torch refuses ids that overflow int32
        raise ValueError(f"token id does not fit in int32: {exc}") from exc
    logprobs = flat([s.response_logprobs for s in samples], torch.float32)
    mask = flat([s.response_mask if s.response_mask is not None
                 else [1] * len(s.response_token_ids) for s in samples], torch.bool)
    if not bool(torch.isfinite(logprobs).all()):
        raise ValueError("a response logprob is NaN or infinite: clamp -inf before recording")
    names = sorted({k for s in samples for k in s.reward_extra})
    if len(names) > MAX_CHUNK_METRICS:
        raise ValueError(f"the samples' rewards report {len(names)} different numbers beside "
                         f"their scores, more than {MAX_CHUNK_METRICS} in one chunk: report "
                         "the same few names for every answer")
    extra = {REWARD_EXTRA: {k: torch.tensor([s.reward_extra.get(k, math.nan) for s in samples],
                                            dtype=torch.float32) for k in names}} if names else {}
    return {
        "schema": CHUNK_SCHEMA,
        "version": CHUNK_VERSION,
        "rank": rank,
        "iteration": iteration,
        "task_ids": [g[0].task_id for g in groups],
        "sample_group": torch.tensor(
            [gi for gi, g in enumerate(groups) for _ in g], dtype=torch.int64
        ),
        "sample_index": torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
        "prompt_tokens": prompt_tokens,
        "prompt_offsets": offsets([len(s.prompt_token_ids) for s in samples]),
        "response_tokens": response_tokens,
        "response_offsets": offsets([len(s.response_token_ids) for s in samples]),
        "response_logprobs": logprobs,
        "response_mask": mask,
        "rewards": torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        "failed": torch.tensor([s.failed for s in samples], dtype=torch.bool),
        "policy_version": torch.tensor([s.policy_version for s in samples], dtype=torch.int64),
        "finish_reasons": [s.finish_reason.value for s in samples],
        "response_texts": [s.response_text for s in samples],
        "errors": [s.error for s in samples],
        **extra,
    }


Problem = Callable[[str], MalformedRecordError]


def decode_chunk(obj: Any, *, path: Path) -> Chunk:
    """Validate a loaded chunk payload; anything off is MalformedRecordError naming path."""

    def bad(problem: str) -> MalformedRecordError:
        return MalformedRecordError(path, f"malformed chunk: {problem}")

    if not isinstance(obj, dict):
        raise bad(f"top level is a {type(obj).__name__}, expected a dict")
    if obj.get("schema") != CHUNK_SCHEMA or obj.get("version") != CHUNK_VERSION:
        raise bad(
            f"schema {obj.get('schema')!r} version {obj.get('version')!r}, expected "
            f"{CHUNK_SCHEMA!r} version {CHUNK_VERSION}"
        )
    for key in ("rank", "iteration"):
        if type(obj.get(key)) is not int:
            raise bad(f"{key} is {obj.get(key)!r}, expected an int")
    tensors, lists = _typed_fields(obj, bad)
    _check_lengths(tensors, lists, bad)
    extra = _reward_extra(obj.get(REWARD_EXTRA, {}), int(tensors["sample_group"].numel()), bad)
    return Chunk(
        rank=obj["rank"],
        iteration=obj["iteration"],
        task_ids=lists["task_ids"],
        tensors=tensors,
        finish_reasons=lists["finish_reasons"],
        response_texts=lists["response_texts"],
        errors=lists["errors"],
        reward_extra=extra,
    )


def _reward_extra(value: Any, num_samples: int, bad: Problem) -> dict[str, torch.Tensor]:
    """The chunk's reward metrics: plain names, a float32 value (or NaN) per sample."""
    if not isinstance(value, dict) or len(value) > MAX_CHUNK_METRICS:
        raise bad(f"{REWARD_EXTRA} must be a dict of at most {MAX_CHUNK_METRICS} metrics")
    for name, t in value.items():
        if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
            raise bad(f"{REWARD_EXTRA} has the name {name!r:.80}, not a metric name")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 \
                or t.numel() != num_samples:
            raise bad(f"{REWARD_EXTRA}[{name!r}] must be a 1-D float32 tensor of one value "
                      f"per sample ({num_samples})")
    return dict(value)


def _typed_fields(
    obj: dict[str, Any], bad: Problem
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """The payload's tensors and string lists, each of its declared type."""
    tensors = {}
    for name, dtype in _TENSORS.items():
        t = obj.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
            raise bad(f"{name} must be a 1-D {dtype} tensor")
        tensors[name] = t
    for name, dtype in _OPTIONAL_TENSORS.items():
        t = obj.get(name)
        if t is None:
            tensors[name] = torch.ones_like(tensors["response_tokens"], dtype=dtype)
        elif not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
            raise bad(f"{name} must be a 1-D {dtype} tensor")
        else:
            tensors[name] = t
    for name, dtype in _OPTIONAL_PER_SAMPLE.items():
        t = obj.get(name)
        if t is None:
            tensors[name] = torch.zeros_like(tensors["sample_index"], dtype=dtype)
        elif not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 \
                or bool((t < 0).any()):
            raise bad(f"{name} must be a 1-D {dtype} tensor of values >= 0")
        else:
            tensors[name] = t
    lists = {}
    for name in _STRING_LISTS:
        value = obj.get(name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(f"{name} must be a list of str")
        lists[name] = tuple(value)
    return tensors, lists


def _check_lengths(
    tensors: dict[str, torch.Tensor], lists: dict[str, tuple[str, ...]], bad: Problem
) -> None:
    """Every per-sample field covers the samples; groups and offsets index what exists."""
    num_groups, num_samples = len(lists["task_ids"]), tensors["sample_group"].numel()
    for name in ("sample_index", "rewards", "failed", "policy_version"):
        if tensors[name].numel() != num_samples:
            raise bad(f"{name} has {tensors[name].numel()} entries for {num_samples} samples")
    for name in ("finish_reasons", "response_texts", "errors"):
        if len(lists[name]) != num_samples:
            raise bad(f"{name} has {len(lists[name])} entries for {num_samples} samples")
    group = tensors["sample_group"]
    if num_samples and (
        int(group.min()) < 0 or int(group.max()) >= num_groups or bool((group.diff() < 0).any())
    ):
        raise bad(f"sample_group must be sorted indices into {num_groups} task ids")
    for kind, values in (("prompt", "prompt_tokens"), ("response", "response_tokens")):
        off = tensors[f"{kind}_offsets"]
        if (
            off.numel() != num_samples + 1
            or int(off[0]) != 0
            or int(off[-1]) != tensors[values].numel()
            or bool((off.diff() < 0).any())
        ):
            raise bad(f"{kind}_offsets do not delimit {values} into {num_samples} samples")
    for name in ("response_logprobs", "response_mask"):
        if tensors[name].numel() != tensors["response_tokens"].numel():
            raise bad(f"{name} and response_tokens differ in length")
    if not bool(torch.isfinite(tensors["rewards"]).all()):
        # A reward is a number: NaN or inf would pass into the metrics (which JSON
        # refuses, stopping the merge outside its checks) or the batch.
        raise bad("rewards must be finite")


def read_verified_chunk(path: Path, entry: ChunkEntry, *,
                        retry_s: float | None = None) -> Chunk:
    """The chunk at `path` if it is the file `entry` lists; decoded and validated.

    Size and SHA-256 are checked on the same descriptor torch.load then reads
    (coordinator/storage/verified.py), so a rename over the path in between cannot
    swap in unverified content.  Where the filesystem can map files the
    tensors stay mapped (MAP_PRIVATE, zero-copy: hashing from the page cache
    and not copying is about twice as fast as read() + torch.load); where it
    cannot (FUSE direct_io), the bytes are read once and loaded from memory.
    Mapping relies on published chunks being immutable (writers only create
    new files by rename).

    IntegrityError: the file is altered or truncated (its groups may be
    redone).  OSError: an I/O error, its path named (never taken as damage).
    """
    with read_verified(path, size=entry.size, sha256=entry.sha256, retry_s=retry_s) as file:
        obj = load_tensors(path, file.source(), mmap=file.mapped)
    return decode_chunk(obj, path=path)
