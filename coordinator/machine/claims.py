"""Rank claims: one daemon per rank, a dead holder's claim replaced by compare-and-swap.

    ranks/<R>/claim.json             the holder's claim: made by an exclusive create
                                     (link(2); a bucket's conditional PUT), removed
                                     by its holder at exit (token checked)
    ranks/<R>/claim.taken-<T>.json   made by an exclusive create by the one daemon
                                     that may replace the claim of token T: its claim
    ranks/<R>/claim.stale-<T>.json   T's claim, set aside by that daemon

A newcomer whose create of claim.json is refused reads the claim there (token
T) and judges its holder (`holder_alive`):

    alive --------------------------------------------------> exit 2 naming it
    dead --> create claim.taken-<T> --refused--> read its taker X:
               |                                  claim.json no longer T -> judge the new one
               |                                  X alive -> exit 2 naming X, the winner
               |                                  X dead (it died half-way): take X's
               |                                  place, create claim.taken-<X> ...
               created --> claim.json still T? --no--> judge again
                           rename it aside, create claim.json --refused--> a newcomer
                                                                  claimed the free rank:
                                                                  judge it

Why the marker: a rename moves whatever file is there, so two newcomers that
both judged T dead could each move the other's fresh claim aside and both run
as the rank.  Only the daemon that made claim.taken-<T> moves T's claim, and
only after reading that claim.json still holds T: a compare-and-swap on the
token, with the exclusive create as its lock, on a filesystem and a bucket
alike.  A daemon that took a claim re-reads it every few beats
(liveness.fence_check), which stops the one left over should a judgment of
death prove wrong (a taker frozen for a whole lease between two calls).
"""

from __future__ import annotations

import enum
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from coordinator.errors import RankHeldError
from coordinator.machine.polling import Backoff, Clock, Wait
from coordinator.records import layout
from coordinator.records.records import LIVE_STATES, Claim, Heartbeat
from coordinator.storage.store import Store, read_record

log = logging.getLogger(__name__)

# Rounds of create, read and judge before giving up: each round ends only when
# what was judged changed under us (another daemon claimed or released the rank).
CLAIM_ROUNDS = 5


def hostname() -> str:
    return socket.gethostname()


def pid_is_dead_here(claim: Claim) -> bool:
    """True when the holder ran on this host and its process is gone."""
    if claim.host != hostname():
        return False
    try:
        proc = psutil.Process(claim.pid)
        # A reused PID belongs to a process started after the claim.
        return proc.create_time() > claim.started + 1.0
    except psutil.NoSuchProcess:
        return True


@dataclass
class _Seen:
    counter: int = -1
    changed_at: float = 0.0


def holder_alive(
    store: Store, claim: Claim, *, lease_s: float, clock: Clock, retry_s: float,
    backoff: Backoff, progress_interval_s: float,
) -> bool:
    """Decide whether a claim's holder lives: at most one lease of watching."""
    if pid_is_dead_here(claim):
        return False
    seen = _Seen(changed_at=clock.now())
    first = True

    def probe() -> bool | None:
        nonlocal first
        hb = read_record(store, layout.heartbeat(claim.rank), Heartbeat, retry_s=retry_s)
        now = clock.now()
        if hb is None or hb.token != claim.token:
            if now - seen.changed_at > lease_s:
                return False
            return None
        if hb.state not in LIVE_STATES:
            return False
        if hb.counter != seen.counter:
            if not first:
                return True  # it advanced while we watched: alive
            seen.counter, seen.changed_at = hb.counter, now
        first = False
        if now - seen.changed_at > lease_s:
            return False
        return None

    wait = Wait(
        deadline_s=lease_s * 2 + 1, backoff=backoff, progress_interval_s=progress_interval_s,
        describe=lambda: f"a sign of life from rank {claim.rank}'s holder (pid {claim.pid} on "
        f"host {claim.host}), to decide whether it can be replaced",
        clock=clock,
    )
    return wait.until(probe)


class Refused(str, enum.Enum):
    """What a refused create of claim.taken-<T> means (`after_refused_marker`)."""

    OURS = "ours"  # the marker holds our claim: our create went through after all
    AGAIN = "again"  # claim.json no longer holds T, or the marker went: judge afresh
    JUDGE_TAKER = "judge_taker"  # another daemon is replacing T: is it alive?


def after_refused_marker(*, own: str, judged: str, current: Claim | None,
                         taker: Claim | None) -> Refused:
    """Decide after another daemon's marker refused ours: `current` is claim.json
    now, `judged` the token found dead there, `taker` the marker's claim."""
    if taker is not None and taker.token == own:
        # A conditional PUT retried after its answer was lost is refused by its
        # own first attempt.
        return Refused.OURS
    if taker is None or current is None or current.token != judged:
        return Refused.AGAIN
    return Refused.JUDGE_TAKER


class Outcome(str, enum.Enum):
    TAKEN = "taken"  # claim.json is ours
    HELD = "held"  # a live daemon holds the rank or is taking it: exit naming it
    AGAIN = "again"  # what was judged changed under us: read and judge again


@dataclass(frozen=True)
class _Judge:
    store: Store
    lease_s: float
    clock: Clock
    retry_s: float
    backoff: Backoff
    progress_interval_s: float

    def alive(self, claim: Claim) -> bool:
        return holder_alive(self.store, claim, lease_s=self.lease_s, clock=self.clock,
                            retry_s=self.retry_s, backoff=self.backoff,
                            progress_interval_s=self.progress_interval_s)


def _take_over(judge: _Judge, holder: Claim, mine: Claim) -> tuple[Outcome, Claim | None]:
    """Replace `holder`'s claim if it and every daemon that started replacing it are
    dead; else the live one, to name."""
    store, retry_s = judge.store, judge.retry_s
    key = layout.claim(mine.rank)
    replacing = holder  # whose place we would take: the holder, then a dead taker's
    while True:
        if judge.alive(replacing):
            return Outcome.HELD, replacing
        marker = layout.claim_taken(mine.rank, replacing.token)
        if store.create_exclusive(marker, mine.to_bytes()):
            break
        taker = read_record(store, marker, Claim, retry_s=retry_s)
        current = read_record(store, key, Claim, retry_s=retry_s)
        step = after_refused_marker(own=mine.token, judged=holder.token, current=current,
                                    taker=taker)
        if step is Refused.OURS:
            break
        if step is Refused.AGAIN:
            return Outcome.AGAIN, None
        assert taker is not None
        log.info("rank %d: pid %d on %s is already replacing the dead holder (pid %d on %s)",
                 mine.rank, taker.pid, taker.host, holder.pid, holder.host)
        replacing = taker
    return _set_aside(store, holder, mine, retry_s=retry_s), None


def _set_aside(store: Store, holder: Claim, mine: Claim, *, retry_s: float) -> Outcome:
    """Ours alone to do (we made the marker of `holder`'s token): move its claim aside
    and create ours."""
    key = layout.claim(mine.rank)
    current = read_record(store, key, Claim, retry_s=retry_s)
    if current is None or current.token != holder.token:
        return Outcome.AGAIN  # its holder released it since: the rank may be free
    why = "a dead holder" + (f" of run {holder.run_id}" if holder.run_id != mine.run_id else "")
    log.warning("taking over rank %d from %s (pid %d on %s)", mine.rank, why, holder.pid,
                holder.host)
    aside = layout.claim_stale(mine.rank, holder.token)
    try:
        store.rename(key, aside)
    except FileNotFoundError:
        return Outcome.AGAIN  # its holder removed it between our read and the rename
    moved = store.read(aside)
    if moved is not None and _token(moved, aside) != holder.token:
        # Race: between our read and the rename its holder released it and a new
        # daemon claimed the free rank.  Give that claim back (unless yet another
        # was made meanwhile: its holder's fence check then stops it).
        store.create_exclusive(key, moved)
        return Outcome.AGAIN
    if store.create_exclusive(key, mine.to_bytes()):
        return Outcome.TAKEN
    return Outcome.AGAIN  # a new daemon found the rank free first: judge it


def _token(data: bytes, key: str) -> str | None:
    """The token of a claim's bytes; None when they are not a claim."""
    try:
        return Claim.from_bytes(data, Path(key)).token
    except ValueError:
        return None


def claim_rank(
    store: Store, claim: Claim, *, lease_s: float, clock: Clock, retry_s: float,
    backoff: Backoff, progress_interval_s: float,
) -> None:
    """Take rank `claim.rank` exclusively, or raise RankHeldError naming the daemon
    that holds it or is taking it over."""
    key = layout.claim(claim.rank)
    judge = _Judge(store, lease_s, clock, retry_s, backoff, progress_interval_s)
    for _ in range(CLAIM_ROUNDS):
        if store.create_exclusive(key, claim.to_bytes()):
            mine = read_record(store, key, Claim, retry_s=retry_s)
            if mine is not None and mine.token == claim.token:
                return
            continue
        holder = read_record(store, key, Claim, retry_s=retry_s)
        if holder is None:
            continue  # its holder removed it between our create and our read
        if holder.token == claim.token:
            return  # our create went through; a retried conditional PUT was refused
        # Whatever run or generation the claim names, only a holder proven
        # dead gives way: two masters racing on a fresh directory name
        # different runs, and the one that holds rank 0 must keep it.
        outcome, winner = _take_over(judge, holder, claim)
        if outcome is Outcome.TAKEN:
            mine = read_record(store, key, Claim, retry_s=retry_s)
            if mine is not None and mine.token == claim.token:
                return
            continue
        if outcome is Outcome.HELD:
            assert winner is not None
            raise _held(claim, holder, winner)
    raise RankHeldError(
        f"could not claim rank {claim.rank}: other daemons kept claiming it; is a second daemon "
        "for this rank starting on another host?",
        rank=claim.rank, host="?", pid=-1,
    )


def _held(claim: Claim, holder: Claim, winner: Claim) -> RankHeldError:
    if winner.token == holder.token:
        what = (f"is already held by pid {winner.pid} on host {winner.host} (run "
                f"{winner.run_id}, started {time.ctime(winner.started)})")
    else:
        what = (f"is being taken over by pid {winner.pid} on host {winner.host} (started "
                f"{time.ctime(winner.started)}), which found its dead holder (pid {holder.pid} "
                f"on host {holder.host}) first")
    return RankHeldError(
        f"rank {claim.rank} of run {claim.run_id} {what}: stop that daemon first, or give "
        "this one another rank or another --run-dir",
        rank=claim.rank, host=winner.host, pid=winner.pid,
    )


def release_claim(store: Store, rank: int, token: str, *, retry_s: float) -> None:
    """Remove our claim at exit, but only if it is still ours."""
    key = layout.claim(rank)
    try:
        current = read_record(store, key, Claim, retry_s=retry_s)
        if current is not None and current.token == token:
            store.remove(key)
    except Exception as exc:  # shutdown path: log and carry on
        log.warning("could not remove the claim of rank %d: %s", rank, exc)
