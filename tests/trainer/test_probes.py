"""Probes: fixed sequences, strict records, and a comparison that tells stale weights apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from coordinator.errors import MalformedRecordError
from trainer.probes import (
    PROBE_COUNT,
    PROBE_ID_LIMIT,
    PROBE_LENGTH,
    ProbeSequence,
    ProbeSet,
    compare,
    make_probe_set,
    moved,
    probe_sequences,
    score,
    tolerance_for,
)

HERE = Path("manifest.json")


def test_sequences_are_a_fixed_function_of_the_vocabulary_avoiding_special_ids() -> None:
    a = probe_sequences(50_000, [0, 1, 2])
    assert a == probe_sequences(50_000, [0, 1, 2])  # every node, every run
    assert len(a) == PROBE_COUNT and all(len(s) == PROBE_LENGTH for s in a)
    ids = {t for s in a for t in s}
    assert ids.isdisjoint({0, 1, 2}) and max(ids) < PROBE_ID_LIMIT
    small = probe_sequences(40, [None, 39])  # a tokenizer without a pad token
    assert all(0 <= t < 39 for s in small for t in s)
    with pytest.raises(ValueError, match="vocab_size=2 leaves 1"):
        probe_sequences(2, [0])


def _bigram(vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Embedding(vocab, vocab)  # logits of the next token from the current one


def test_score_is_the_log_softmax_of_the_next_token_and_compare_finds_the_worst() -> None:
    model = _bigram(64, 0)
    seqs = probe_sequences(64)
    values = score(model, seqs)
    assert len(values) == PROBE_COUNT and all(len(v) == PROBE_LENGTH - 1 for v in values)
    s, t = seqs[1], 3
    expected = torch.log_softmax(model.weight[s[t - 1]].detach(), -1)[s[t]].item()
    assert values[1][t - 1] == pytest.approx(expected, abs=1e-6)

    probes = make_probe_set(model, vocab_size=64, special_ids=(), dtype="float32")
    same = compare(probes, score(model, seqs), tolerance_for("float32"))
    assert same.passed and same.mean_abs_diff == 0.0
    bumped = [list(v) for v in values]
    bumped[2][5] -= 0.5
    check = compare(probes, bumped, tolerance_for("float32"))
    assert check.worst == (2, 6) and check.max_abs_diff == pytest.approx(0.5)
    assert check.mean_abs_diff == pytest.approx(0.5 / (PROBE_COUNT * (PROBE_LENGTH - 1)))
    assert not check.passed  # 0.0083 > 2e-3
    with pytest.raises(ValueError, match="probe 0: 3 served"):
        compare(probes, [[0.0] * 3, *bumped[1:]], 1.0)


def test_other_weights_move_the_probes_far_beyond_any_tolerance() -> None:
    old = make_probe_set(_bigram(64, 0), vocab_size=64, special_ids=(), dtype="float32")
    new = make_probe_set(_bigram(64, 1), vocab_size=64, special_ids=(), dtype="float32")
    shift = moved(old, new)
    assert shift is not None and shift > tolerance_for("bfloat16")
    other = make_probe_set(_bigram(80, 0), vocab_size=80, special_ids=(), dtype="float32")
    assert moved(old, other) is None  # different sequences: not comparable


def test_tolerance_is_the_coarsest_dtypes() -> None:
    assert tolerance_for("float32") < tolerance_for("float32", "float16") < tolerance_for(
        "bfloat16")
    assert tolerance_for("float32", "int8") == tolerance_for("bfloat16")  # unknown: coarsest


def test_probe_records_round_trip_and_refuse_bad_values() -> None:
    probes = make_probe_set(_bigram(64, 0), vocab_size=64, special_ids=(), dtype="float32")
    assert ProbeSet.from_json(probes.to_json(), HERE) == probes
    body = probes.to_json()
    fields = {k: v for k, v in body.items() if k not in ("schema", "version")}
    for bad, rule in [({"dtype": "float64"}, "probe dtype 'float64'"),
                      ({"sequences": []}, "0 probes"),
                      ]:
        with pytest.raises(MalformedRecordError, match=rule):
            ProbeSet.from_fields({**fields, **bad}, HERE)
    for token_ids, logprobs, rule in [
        ([5], [], "1 tokens, not 2"),
        ([5, -1], [-1.0], "integers >= 0"),
        ([5, 6], [0.5], "log-probabilities <= 0"),
        ([5, 6], [-1.0, -2.0], "needs 1 finite"),
    ]:
        with pytest.raises((ValueError, MalformedRecordError), match=rule):
            ProbeSequence(token_ids=tuple(token_ids), logprobs=tuple(logprobs))
    with pytest.raises(MalformedRecordError):
        ProbeSequence.from_fields({"token_ids": [1, 2], "logprobs": [math.nan]}, HERE)
