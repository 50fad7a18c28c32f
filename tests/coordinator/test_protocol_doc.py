"""docs/PROTOCOL.md is the source of truth: its tables must match the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from coordinator.config.run_config import CoordinationConfig
from coordinator.errors import EXIT_CODE_MEANINGS, ExitCode
from coordinator.records.phases import PHASES

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def table(marker: str) -> list[list[str]]:
    text = DOC.read_text()
    body = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0]
    rows = [line.strip().strip("|").split("|") for line in body.strip().splitlines()]
    return [[c.strip() for c in row] for row in rows[2:]]  # drop header and rule


def test_the_phase_table_matches_the_code() -> None:
    rows = table("phase-table")
    expected = [[str(int(s.phase)), s.phase.name.lower(), s.who.value, s.what,
                 s.release_carries, s.timeout.value] for s in PHASES]
    assert rows == expected


def test_the_timeout_table_lists_every_key_with_its_default() -> None:
    rows = {r[0].strip("`"): r[1] for r in table("timeouts")}
    expected = {}
    defaults = CoordinationConfig()
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            for g in dataclasses.fields(value):
                expected[f"coordination.{f.name}.{g.name}"] = str(getattr(value, g.name))
        else:
            expected[f"coordination.{f.name}"] = str(getattr(value, "value", value))
    assert rows == expected


def test_the_exit_code_table_matches_the_code() -> None:
    rows = table("exit-codes")
    assert rows == [[str(int(c)), c.name, EXIT_CODE_MEANINGS[c]] for c in ExitCode]


def test_the_node_local_table_matches_every_action_kind() -> None:
    from coordinator.machine.actions import kind, kind_names

    rows = [r[0].strip("`") for r in table("node-local")]
    keys = [k for name in kind_names() for k in kind(name).node_local]
    assert rows == keys


def test_the_recovery_record_and_heartbeat_states_are_documented_field_by_field() -> None:
    from coordinator.machine.regroup import Recovery, RecoveryLog
    from coordinator.records.records import NodeState

    text = DOC.read_text()
    section = text.split("**`recoveries.json`**")[1].split("\n\n")[0]
    for f in (*dataclasses.fields(RecoveryLog), *dataclasses.fields(Recovery)):
        assert f"`{f.name}`" in section, f"recoveries.json field {f.name} is not documented"
    assert f"(`{RecoveryLog.SCHEMA}`)" in section
    states = text.split("**heartbeat** `ranks/<R>/heartbeat.json`")[1].split("\n\n")[0]
    for state in NodeState:
        assert f"`{state.value}`" in states, f"heartbeat state {state.value} is not documented"


def test_the_on_failure_table_covers_every_policy_and_the_doc_and_help_come_from_it() -> None:
    import subprocess
    import sys

    from coordinator.config.on_failure import POLICIES, OnFailure, cli_help

    assert set(POLICIES) == set(OnFailure)
    rows = table("on-failure")
    assert [r[0].split()[0].strip("`") for r in rows] == [m.value for m in POLICIES]
    script = Path(__file__).resolve().parents[2] / "scripts" / "update_docs.py"
    check = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    for mode, p in POLICIES.items():
        assert f"{mode.value} ({p.summary}" in cli_help()


def test_every_protocol_record_is_documented_field_by_field_and_only_with_its_fields() -> None:
    """Each record's paragraph ("**name** `file`: ...") names every field of its
    dataclass; a field named there that the record lacks (the release's old
    `reason`, since in `abort`) is caught by the dataclass's own list."""
    import re

    from coordinator.records.records import (
        Abort,
        AbortKind,
        Arrival,
        ArrivalStatus,
        Claim,
        Decision,
        Heartbeat,
        Journal,
        Manifest,
        NodeState,
        Refusal,
        Release,
        Session,
    )

    text = DOC.read_text()
    records = {"manifest": Manifest, "claim": Claim, "heartbeat": Heartbeat, "session": Session,
               "arrival": Arrival, "release": Release, "refusal": Refusal, "journal": Journal}
    for name, record in records.items():
        paragraph = re.search(rf"^\*\*{name}\*\* `[^`]+`: (.*?)(?:\n\n|\Z)", text, re.S | re.M)
        assert paragraph is not None, f"no paragraph documents the {name} record"
        body = paragraph[1]
        fields = {f.name for f in dataclasses.fields(record)}
        for field in sorted(fields):
            assert f"`{field}`" in body, f"{name}: field {field} is not documented"
        # Outside its parentheses (which explain a field: its values, a payload's
        # keys), the paragraph lists only fields the record has.
        flat = " ".join(body.split())
        while (inner := re.sub(r"\([^()]*\)", "", flat)) != flat:
            flat = inner
        listed = re.findall(r"(?:^|, )`([a-z_]+)`", flat)
        values = {v.value for e in (NodeState, AbortKind, Decision, ArrivalStatus) for v in e}
        extra = set(listed) - fields - values - {f.name for f in dataclasses.fields(Abort)}
        assert not extra, f"{name}: documented fields {sorted(extra)} are not in {record.__name__}"
