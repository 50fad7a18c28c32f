"""Probes: what a checkpoint's weights say about a few fixed token sequences.

Engines have been seen serving the old weights after an update (vLLM issue
32718, TRL issue 5312), silently.  So at publish (phase 11) the trainer scores
PROBE_COUNT fixed sequences with the weights it saves and writes the
log-probabilities into the checkpoint's manifest; at phase 12 every node asks
its engine for the same sequences' prompt log-probabilities and compares
(rl/engine_host.py).  A difference beyond the tolerance means the engine does
not serve this checkpoint.

    sequences   PROBE_COUNT x PROBE_LENGTH token ids, a fixed function of the
                vocabulary size (seeded), avoiding the special tokens and ids
                above PROBE_ID_LIMIT (every tokenizer has those ids)
    logprobs    log_softmax of the logits after tokens 0..t-1, at token t, for
                t = 1..PROBE_LENGTH-1: what vLLM answers with echo + logprobs
    tolerance   on the mean absolute difference over every probed token, set by
                the coarser of the trainer's and the engine's dtypes

The check is conclusive only when an update moves the probes by more than
the tolerance; `moved` (old vs new expected values) tells the caller whether
it did, so a stale engine cannot hide behind a tiny learning rate unnoticed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from coordinator.records.records import Record

PROBE_COUNT: Final = 4
PROBE_LENGTH: Final = 16
PROBE_ID_LIMIT: Final = 4096
PROBE_SEED: Final = 20261123
MAX_PROBES: Final = 16
MAX_PROBE_LENGTH: Final = 256
# Mean |served - expected| allowed, by the coarsest dtype involved.  float32
# differs only by kernel order (~1e-6); half precision keeps 10 (bf16: 7)
# mantissa bits, and a log-probability of -10 is then off by up to ~0.05.
TOLERANCE_BY_DTYPE: Final = {"float32": 2e-3, "float16": 3e-2, "bfloat16": 1e-1}


@dataclass(frozen=True, kw_only=True)
class ProbeSequence(Record):
    SCHEMA: ClassVar[str] = "coordinator/checkpoint-manifest/probe"
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 2 <= len(self.token_ids) <= MAX_PROBE_LENGTH:
            raise ValueError(f"a probe has {len(self.token_ids)} tokens, not 2..{MAX_PROBE_LENGTH}")
        if any(type(t) is not int or t < 0 for t in self.token_ids):
            raise ValueError("probe token ids must be integers >= 0")
        if len(self.logprobs) != len(self.token_ids) - 1 or not all(
                math.isfinite(v) and v <= 0 for v in self.logprobs):
            raise ValueError(f"a probe of {len(self.token_ids)} tokens needs "
                             f"{len(self.token_ids) - 1} finite log-probabilities <= 0")


@dataclass(frozen=True, kw_only=True)
class ProbeSet(Record):
    """The probes of one checkpoint and the dtype the trainer computed them in."""

    SCHEMA: ClassVar[str] = "coordinator/checkpoint-manifest/probes"
    dtype: str
    sequences: tuple[ProbeSequence, ...]

    def __post_init__(self) -> None:
        if self.dtype not in TOLERANCE_BY_DTYPE:
            raise ValueError(f"probe dtype {self.dtype!r} is not one of {list(TOLERANCE_BY_DTYPE)}")
        if not 1 <= len(self.sequences) <= MAX_PROBES:
            raise ValueError(f"{len(self.sequences)} probes: expected 1..{MAX_PROBES}")


def probe_sequences(vocab_size: int, special_ids: Sequence[int | None] = (), *,
                    count: int = PROBE_COUNT, length: int = PROBE_LENGTH) -> list[list[int]]:
    """The fixed sequences for a vocabulary: same size, same sequences, on every node."""
    usable = [i for i in range(min(vocab_size, PROBE_ID_LIMIT)) if i not in set(special_ids)]
    if len(usable) < 2:
        raise ValueError(f"vocab_size={vocab_size} leaves {len(usable)} ordinary token ids")
    rng = random.Random(PROBE_SEED)
    return [[rng.choice(usable) for _ in range(length)] for _ in range(count)]


def score(logits_of: Callable[[Any], Any], sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Log-probabilities of tokens 1..n-1 of equal-length sequences under `logits_of`."""
    import torch

    ids = torch.tensor([list(s) for s in sequences], dtype=torch.long)
    with torch.no_grad():
        logits = logits_of(ids).float().cpu()
    logp = torch.log_softmax(logits[:, :-1, :], dim=-1)
    return logp.gather(2, ids[:, 1:, None])[:, :, 0].tolist()  # type: ignore[no-any-return]


def make_probe_set(logits_of: Callable[[Any], Any], *, vocab_size: int,
                   special_ids: Sequence[int | None], dtype: str) -> ProbeSet:
    sequences = probe_sequences(vocab_size, special_ids)
    scored = score(logits_of, sequences)
    return ProbeSet(dtype=dtype, sequences=tuple(
        ProbeSequence(token_ids=tuple(s), logprobs=tuple(v))
        for s, v in zip(sequences, scored, strict=True)))


@dataclass(frozen=True)
class ProbeCheck:
    """Served against expected log-probabilities of one probe set."""

    mean_abs_diff: float
    max_abs_diff: float
    worst: tuple[int, int]  # (probe, token position) of the largest difference
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.mean_abs_diff <= self.tolerance


def tolerance_for(*dtypes: str) -> float:
    """The tolerance of the coarsest dtype; unknown names count as bfloat16."""
    return max(TOLERANCE_BY_DTYPE.get(d, TOLERANCE_BY_DTYPE["bfloat16"]) for d in dtypes)


def compare(expected: ProbeSet, served: Sequence[Sequence[float]], tolerance: float) -> ProbeCheck:
    """How far `served` (one list per probe, positions 1..n-1) is from `expected`."""
    diffs: list[tuple[float, tuple[int, int]]] = []
    for p, (probe, values) in enumerate(zip(expected.sequences, served, strict=True)):
        if len(values) != len(probe.logprobs):
            raise ValueError(f"probe {p}: {len(values)} served log-probabilities for "
                             f"{len(probe.logprobs)} expected")
        diffs += [(abs(a - b), (p, t + 1))
                  for t, (a, b) in enumerate(zip(values, probe.logprobs, strict=True))]
    largest, worst = max(diffs)
    return ProbeCheck(mean_abs_diff=sum(d for d, _ in diffs) / len(diffs),
                      max_abs_diff=largest, worst=worst, tolerance=tolerance)


def moved(old: ProbeSet, new: ProbeSet) -> float | None:
    """Mean |new - old| over the probes when both scored the same sequences, else None."""
    if [s.token_ids for s in old.sequences] != [s.token_ids for s in new.sequences]:
        return None
    return compare(old, [s.logprobs for s in new.sequences], 1.0).mean_abs_diff
