"""Where each record lives in the run directory (see docs/PROTOCOL.md).

Keys are relative POSIX paths.  Ranks, iterations and phases are checked
before they become part of a path, so a corrupt or hostile record can never
steer a daemon to read or write outside the run directory.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from coordinator.records.bounds import check_iteration, check_phase, check_rank

MANIFEST: Final = "run.json"
SESSION: Final = "session.json"
RECOVERIES: Final = "recoveries.json"
RANKS: Final = "ranks"
ITERATIONS: Final = "iterations"
_ITERATION_NAME: Final = re.compile(r"\d{6}")  # iterations/<NNNNNN>
CHECKPOINTS: Final = "checkpoints"
ARCHIVE: Final = "archive"
# Published by a master that refused its own settings at start, removed by the next
# one that starts (coordinator/machine/refusal.py).
MASTER_REFUSAL: Final = "master-refusal.json"


def rank_dir(rank: int) -> str:
    return f"{RANKS}/{check_rank(rank)}"


def claim(rank: int) -> str:
    return f"{rank_dir(rank)}/claim.json"


def claim_taken(rank: int, token: str) -> str:
    """Created exclusively by the one daemon that may replace the claim of `token`
    (coordinator/machine/claims.py): its own claim."""
    return f"{rank_dir(rank)}/claim.taken-{_token_name(token)}.json"


def claim_stale(rank: int, token: str) -> str:
    """The claim of `token`, set aside by the daemon that took its place."""
    return f"{rank_dir(rank)}/claim.stale-{_token_name(token)}.json"


# A daemon's token (secrets.token_hex) as it is; anything else a claim in the
# untrusted run directory names, by digest: never a path of its own making.
_TOKEN: Final = re.compile(r"[0-9A-Za-z_-]{1,64}")


def _token_name(token: str) -> str:
    if _TOKEN.fullmatch(token):
        return token
    return "sha256-" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def heartbeat(rank: int) -> str:
    return f"{rank_dir(rank)}/heartbeat.json"


def journal(rank: int) -> str:
    return f"{rank_dir(rank)}/journal.json"


def logs(rank: int) -> str:
    return f"{rank_dir(rank)}/logs"


def iteration_named(name: str) -> int | None:
    """The iteration an `iterations/` entry is the directory of (None: not one)."""
    return int(name) if _ITERATION_NAME.fullmatch(name) else None


def iteration_dir(iteration: int) -> str:
    return f"{ITERATIONS}/{check_iteration(iteration):06d}"


def phase_dir(iteration: int, phase: int) -> str:
    return f"{iteration_dir(iteration)}/phase-{check_phase(phase):02d}"


def arrival(iteration: int, phase: int, rank: int) -> str:
    return f"{phase_dir(iteration, phase)}/arrive-{check_rank(rank)}.json"


def release(iteration: int, phase: int) -> str:
    return f"{phase_dir(iteration, phase)}/release.json"


def timings(iteration: int, rank: int) -> str:
    return f"{iteration_dir(iteration)}/timings/rank-{check_rank(rank)}.json"


def checkpoint(iteration: int) -> str:
    return f"{CHECKPOINTS}/iter-{check_iteration(iteration):06d}"
