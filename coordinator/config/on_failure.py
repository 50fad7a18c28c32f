"""What survivors do after a lost rank or a failed step: one table of policies.

    policy   regroups  shrinks  in words
    wait     yes       no       re-form the group, wait for the rank to return
    shrink   yes       yes      as wait; after shrink_after_s go on without it
    exit     no        no       every daemon exits with the failure's code

`POLICIES` maps each `coordination.on_failure` value to its behaviour.  The
phase machine asks the table (regroup.py, group.py, daemon.py) and never
names a policy; `--on-failure`'s help and PROTOCOL.md's table are generated
from it (scripts/update_docs.py), and a test asserts the table covers every
value, as the phase table covers every phase.  A new policy is one enum
member and one entry.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final


class OnFailure(str, enum.Enum):
    """The values of coordination.on_failure (`--on-failure`)."""

    WAIT = "wait"
    SHRINK = "shrink"
    EXIT = "exit"


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    # Survivors stop their work and re-form the group (regroup.py) instead of
    # exiting, up to coordination.max_recoveries times.
    regroups: bool
    # A re-forming group may go on without missing workers once
    # coordination.shrink_after_s passed (group.py); they rejoin at a boundary.
    shrinks: bool
    summary: str  # one clause, for the CLI help and the docs


POLICIES: Final[Mapping[OnFailure, FailurePolicy]] = {
    OnFailure.WAIT: FailurePolicy(
        regroups=True, shrinks=False,
        summary="survivors re-form the group and wait for the lost rank to come back "
                "(coordination.rejoin_timeout_s); a failed step is redone"),
    OnFailure.SHRINK: FailurePolicy(
        regroups=True, shrinks=True,
        summary="as wait, but after coordination.shrink_after_s the group goes on without "
                "a missing worker (down to coordination.min_nodes); it rejoins at the next "
                "iteration boundary"),
    OnFailure.EXIT: FailurePolicy(
        regroups=False, shrinks=False,
        summary="every daemon exits with the failure's code; clean up with `coordinator "
                "recover` and restart every node"),
}
assert set(POLICIES) == set(OnFailure), "POLICIES must give every on_failure value a policy"

DEFAULT: Final = OnFailure.WAIT


def policy(mode: OnFailure) -> FailurePolicy:
    return POLICIES[mode]


def cli_help() -> str:
    """--on-failure's help, from the table."""
    parts = [f"{mode.value} ({p.summary}{'; the default' if mode is DEFAULT else ''})"
             for mode, p in POLICIES.items()]
    return "After a lost node or a failed step: " + "; ".join(parts) + "."


def markdown_table() -> str:
    """PROTOCOL.md's on-failure table, from the table."""
    yes = {True: "yes", False: "no"}
    rows = ["| `on_failure` | regroups | shrinks | what survivors do |", "|---|---|---|---|"]
    rows += [f"| `{mode.value}`{' (default)' if mode is DEFAULT else ''} | {yes[p.regroups]} | "
             f"{yes[p.shrinks]} | {p.summary} |" for mode, p in POLICIES.items()]
    return "\n".join(rows)
