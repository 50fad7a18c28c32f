"""Records are parsed strictly: wrong or missing fields are malformed, with the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.errors import MalformedRecordError
from coordinator.records.records import (
    Abort,
    AbortKind,
    Decision,
    Heartbeat,
    Journal,
    NodeState,
    Release,
)
from coordinator.storage.store import FsStore, MemoryStore, read_record

P = Path("x.json")


def heartbeat(**changes) -> Heartbeat:
    base = dict(run_id="r", generation=0, rank=1, token="t", host="h", pid=1, counter=3,
                state=NodeState.RUNNING, iteration=2, phase=4, waiting_for="", arrived=(2, 3),
                released=None, session="s", resume_iteration=2, abort=None, error=None,
                wall_time=1.0)
    base.update(changes)
    return Heartbeat(**base)


def test_a_record_round_trips_through_json() -> None:
    hb = heartbeat(abort=Abort(kind=AbortKind.LOST, reason="gone", rank=2, iteration=1, phase=3))
    again = Heartbeat.from_bytes(hb.to_bytes(), P)
    assert again == hb
    assert json.loads(hb.to_bytes())["schema"] == "coordinator/heartbeat"


def test_unknown_fields_are_ignored_so_newer_writers_can_add_fields() -> None:
    body = heartbeat().to_json() | {"added_later": 1}
    assert Heartbeat.from_json(body, P) == heartbeat()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("counter", "3", "must be an integer"),
    ("state", "sleeping", "expected one of"),
    ("rank", 99999, "outside"),
    ("arrived", [1], "must have 2 items"),
    ("wall_time", float("inf"), "finite"),
])
def test_a_mistyped_field_makes_the_record_malformed_naming_the_path(field, value, message) -> None:
    body = heartbeat().to_json()
    body[field] = value
    with pytest.raises(MalformedRecordError, match=message) as info:
        Heartbeat.from_json(body, P)
    assert info.value.path == P


def test_a_missing_field_or_foreign_schema_is_malformed() -> None:
    body = heartbeat().to_json()
    del body["token"]
    with pytest.raises(MalformedRecordError, match="'token' is missing"):
        Heartbeat.from_json(body, P)
    with pytest.raises(MalformedRecordError, match="schema"):
        Journal.from_json(heartbeat().to_json(), P)


def test_a_release_carries_an_abort_exactly_when_it_aborts() -> None:
    with pytest.raises(ValueError, match="abort"):
        Release(run_id="r", generation=0, session="s", iteration=0, phase=0,
                decision=Decision.ABORT, abort=None, payload={})


def test_journal_says_what_is_done_and_where_to_resume() -> None:
    j = Journal(run_id="r", rank=0, completed_iteration=-1, iteration=0, done=())
    j = j.with_done(0, 1).with_done(0, 3)
    assert j.is_done(0, 1) and j.is_done(0, 3) and not j.is_done(0, 2)
    j = j.with_completed(0)
    assert j.resume_iteration == 1 and j.is_done(0, 13) and not j.is_done(1, 0)
    assert j.with_done(1, 2).done == (2,)
    # A group that resumed behind this rank replays iteration 0: completing it
    # again keeps what this rank has done of iteration 1.
    ahead = j.with_done(1, 1)
    assert ahead.with_completed(0) == ahead and ahead.is_done(1, 1)


def test_a_replayed_iteration_keeps_the_done_phases_of_the_later_one() -> None:
    # Ranks 0 and 1 completed iteration 2 and did phases 0-9 of iteration 3; the
    # group replays iteration 1 (a rank behind them), where a collective step
    # runs again on every rank: marking it done must not forget iteration 3.
    j = Journal(run_id="r", rank=0, completed_iteration=2, iteration=3, done=tuple(range(10)))
    assert j.with_done(1, 10) == j
    assert j.with_done(2, 0) == j
    assert all(j.is_done(3, p) for p in range(10)) and j.resume_iteration == 3


def test_read_record_retries_a_torn_file_then_names_it(tmp_path: Path) -> None:
    store = FsStore(tmp_path)
    (tmp_path / "hb.json").write_bytes(heartbeat().to_bytes()[:40])
    slept: list[float] = []
    with pytest.raises(MalformedRecordError) as info:
        read_record(store, "hb.json", Heartbeat, retry_s=0.05, sleep=slept.append)
    assert info.value.path == tmp_path / "hb.json"
    assert slept, "a torn read is retried before it is reported"


def test_the_read_deadline_defaults_to_the_daemons_setting_and_reaches_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader given no deadline takes the process's (coordination.read_retry_s,
    set by the daemon; a trainer takes it from READ_RETRY_ENV)."""
    import time

    from coordinator.storage import fsio

    before = fsio.read_retry(None)
    try:
        monkeypatch.setenv(fsio.READ_RETRY_ENV, "0.2")
        fsio.read_retry_from_env()
        assert fsio.read_retry(None) == 0.2 and fsio.read_retry(3.0) == 3.0
        (tmp_path / "hb.json").write_bytes(heartbeat().to_bytes()[:40])
        started = time.monotonic()
        with pytest.raises(MalformedRecordError):
            read_record(FsStore(tmp_path), "hb.json", Heartbeat)
        assert 0.2 <= time.monotonic() - started < 2.0
        monkeypatch.setenv(fsio.READ_RETRY_ENV, "-1")
        with pytest.raises(ValueError, match=r"COORDINATOR_READ_RETRY_S='-1': read retry -1.0 s "
                                             r"is outside 0\.\.600"):
            fsio.read_retry_from_env()
    finally:
        fsio.set_read_retry(before)


def test_read_record_returns_none_for_an_absent_file() -> None:
    assert read_record(MemoryStore(), "nope.json", Heartbeat) is None


@pytest.mark.parametrize(("data", "error"), [
    (b"[" * 100_000, "RecursionError"),  # nested past the interpreter's limit
    (b'{"counter": ' + b"9" * 5000 + b"}", "ValueError"),  # more digits than int() takes
    (b"\xff\xfe", "JSONDecodeError"),
])
def test_json_no_parser_survives_is_a_malformed_record_naming_the_file(
        data: bytes, error: str) -> None:
    with pytest.raises(MalformedRecordError, match=rf"x\.json: not valid JSON \({error}"):
        Heartbeat.from_bytes(data, P)
