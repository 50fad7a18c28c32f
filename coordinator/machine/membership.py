"""Joining the group: finding the master, forming a session.

A daemon first takes its rank's claim (coordinator/machine/claims.py: exclusive, taken
over from a holder proven dead by compare-and-swap); `claim_rank`, `release_claim`
and `hostname` are named here too, where the daemon has always called them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import (
    MalformedRecordError,
    PeerLostError,
    PhaseFailedError,
    RunCompleted,
)
from coordinator.machine import netaddr
from coordinator.machine.claims import claim_rank as claim_rank
from coordinator.machine.claims import hostname as hostname
from coordinator.machine.claims import release_claim as release_claim
from coordinator.machine.decisions import (
    GatherAction,
    Liveness,
    MasterFound,
    MasterNews,
    Quorum,
    Seen,
    judge_gathering,
    judge_liveness,
    judge_master,
    master_before_group,
    session_is_ours,
)
from coordinator.machine.polling import Backoff, Clock, Wait
from coordinator.records import layout
from coordinator.records.records import (
    JOINABLE_STATES,
    AbortKind,
    Claim,
    Heartbeat,
    Manifest,
    NodeState,
    Session,
)
from coordinator.storage.store import Store, publish_record, read_record

log = logging.getLogger(__name__)


def unfinished_master(store: Store, run_id: str, *, retry_s: float) -> Heartbeat | None:
    """The last heartbeat of rank 0 in this run when it did not stop cleanly: a new
    master replacing it records the restart as a recovery (regroup.py)."""
    before = read_record(store, layout.heartbeat(0), Heartbeat, retry_s=retry_s)
    if before is not None and before.run_id == run_id and before.state is not NodeState.FINISHED:
        return before
    return None


def master_gave_up(hb: Heartbeat) -> PeerLostError | PhaseFailedError:
    """The error a worker exits with when the master stopped for good."""
    message = (f"the master (pid {hb.pid} on {hb.host}) stopped for good at iteration "
               f"{hb.iteration}: {hb.error or 'no reason given'}")
    if hb.abort is not None and hb.abort.kind is not AbortKind.LOST:
        error = PhaseFailedError(message, rank=hb.abort.rank, iteration=hb.iteration,
                                 phase=hb.phase, cause=hb.abort.reason)
        error.exit_code = hb.abort.kind.exit_code
        return error
    return PeerLostError(message, rank=0, host=hb.host)


@dataclass(frozen=True)
class MasterInfo:
    manifest: Manifest
    claim: Claim


def wait_for_master(
    store: Store, *, run_dir: str, join_timeout_s: float, backoff: Backoff,
    progress_interval_s: float, retry_s: float, probe_timeout_s: float,
    clock: Clock | None = None, check: Callable[[], None] | None = None,
    gave_up_token: str | None = None, note: Callable[[], str] | None = None,
) -> MasterInfo:
    """Worker: wait until a live master announces a run, then check it is reachable.

    `gave_up_token`: the master this worker was in a group with.  Its heartbeat
    saying `failed` means it stopped for good (an error it does not recover
    from, or coordination.max_recoveries used up): raised at once as that
    master's failure.  Gone without a word, or `left`, it may be restarted:
    waited for.  `note`: added to what the wait says it waits for (the master's
    last start, refused: coordinator/machine/refusal.py).
    """
    clock = clock or Clock()
    state = {"why": f"the master: no run manifest at {run_dir}/run.json yet (start "
             "`coordinator run --master ...` with the same --run-dir)"}
    seen: dict[str, Seen] = {}

    def probe() -> MasterInfo | None:
        manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=retry_s)
        claim = hb = None
        if manifest is not None:
            claim = read_record(store, layout.claim(0), Claim, retry_s=retry_s)
            hb = read_record(store, layout.heartbeat(0), Heartbeat, retry_s=retry_s)
        found = judge_master(manifest, claim, hb, gave_up_token=gave_up_token,
                             seen=seen.get(hb.token) if hb is not None else None)
        if found is MasterFound.FOUND:
            assert manifest is not None and claim is not None
            return MasterInfo(manifest=manifest, claim=claim)
        if found is MasterFound.NO_RUN:
            return None
        assert manifest is not None
        if found is MasterFound.GAVE_UP:
            assert hb is not None
            raise master_gave_up(hb)
        if found is MasterFound.UNREGISTERED:
            state["why"] = (f"the master of run {manifest.run_id}: it has not registered yet "
                            f"(no current {run_dir}/ranks/0/claim.json and heartbeat)")
            return None
        assert hb is not None
        if found is MasterFound.NOT_LIVE:
            state["why"] = (f"the master of run {manifest.run_id}: its last heartbeat says "
                            f"{hb.state.value} (pid {hb.pid} on {hb.host}); restart it")
            return None
        seen.setdefault(hb.token, Seen(hb.counter, clock.now(), hb.token))
        state["why"] = (f"a heartbeat from the master of run {manifest.run_id} (pid "
                        f"{hb.pid} on {hb.host}) to prove it is alive")
        return None

    info = Wait(
        deadline_s=join_timeout_s, backoff=backoff, progress_interval_s=progress_interval_s,
        describe=lambda: state["why"] + (note() if note is not None else ""), clock=clock,
        check=check,
    ).until(probe)
    address, port = info.claim.address, info.claim.probe_port
    if port is not None:
        errors: list[str] = []

        def reach() -> bool | None:
            try:
                netaddr.probe(address, port, timeout_s=probe_timeout_s)
                return True
            except OSError as exc:
                errors[:] = [str(exc)]
                return None

        Wait(
            deadline_s=max(probe_timeout_s * 3, 10.0), backoff=backoff,
            progress_interval_s=progress_interval_s, clock=clock, check=check,
            describe=lambda: (f"a TCP connection to the master at {address}:{port} (host "
                              f"{info.claim.host}): {errors[0] if errors else 'no answer'}; if "
                              "this address is wrong, pass --node-ip or --ifname to the master"),
        ).until(reach)
    return info


def out_of_session(store: Store, rank: int, *, run_id: str, generation: int,
                   retry_s: float) -> tuple[Claim, Heartbeat] | None:
    """The current claim of `rank` and its heartbeat, if it says the rank is out of any
    session: starting, or regrouping with its work stopped (a rank that has only
    just seen a failure still names its session).  Not proof of life: the caller
    watches the counter."""
    claim = read_record(store, layout.claim(rank), Claim, retry_s=retry_s)
    if claim is None or claim.run_id != run_id or claim.generation != generation:
        return None
    hb = read_record(store, layout.heartbeat(rank), Heartbeat, retry_s=retry_s)
    if hb is None or hb.token != claim.token or hb.state not in JOINABLE_STATES \
            or hb.session is not None:
        return None
    return claim, hb


def gather_members(
    store: Store, *, run_id: str, generation: int, num_nodes: int, own: Heartbeat,
    join_timeout_s: float, lease_s: float, backoff: Backoff, progress_interval_s: float,
    retry_s: float, clock: Clock | None = None, check: Callable[[], None] | None = None,
    describe_wait: Callable[[list[int]], str] | None = None, quorum: Quorum | None = None,
) -> tuple[dict[int, Claim], dict[int, Heartbeat]]:
    """Master: wait until every rank has a current claim and a live heartbeat, out of
    any session (starting, or regrouping after a failure: its work is stopped).

    With a `quorum`, the ranks present once its `after_s` have passed are enough
    if they are at least its `nodes` (the master included); fewer is a
    PeerLostError naming the missing ranks (coordination.on_failure "shrink")."""
    clock = clock or Clock()
    claims: dict[int, Claim] = {}
    beats: dict[int, Heartbeat] = {0: own}
    seen: dict[int, Seen] = {}
    missing = list(range(1, num_nodes))
    started = clock.now()

    def probe() -> bool | None:
        now = clock.now()
        for rank in list(missing):
            found = out_of_session(store, rank, run_id=run_id, generation=generation,
                                   retry_s=retry_s)
            if found is None:
                continue
            claim, hb = found
            liveness = judge_liveness(hb, seen.get(rank))
            if liveness is Liveness.FIRST_SEEN:
                seen[rank] = Seen(hb.counter, now, hb.token)
            if liveness is Liveness.ALIVE:
                claims[rank], beats[rank] = claim, hb
                missing.remove(rank)
        action = judge_gathering(missing=len(missing), present=len(beats),
                                 waited_s=now - started, quorum=quorum)
        if action is GatherAction.TOO_FEW:
            assert quorum is not None
            raise PeerLostError(
                f"only {len(beats)} of {num_nodes} nodes are back after {quorum.after_s:g} s "
                f"(rank(s) {missing} missing) and {quorum.rule} needs {quorum.nodes}: "
                "restart the missing nodes with their original command (the run resumes "
                "where it stopped)", rank=missing[0])
        return True if action is GatherAction.FORM else None

    def describe() -> str:
        if describe_wait is not None:
            return describe_wait(missing)
        return (f"rank(s) {missing} to join run {run_id} (start `coordinator run --worker R "
                f"--run-dir ...` on each node)")

    Wait(deadline_s=join_timeout_s, backoff=backoff, progress_interval_s=progress_interval_s,
         describe=describe, clock=clock, check=check).until(probe)
    return claims, beats


def publish_session(store: Store, session: Session) -> None:
    publish_record(store, layout.SESSION, session)


def read_session(store: Store, *, run_id: str, generation: int, retry_s: float,
                 ) -> Session | None:
    """The last session the master published in this run and generation, if any."""
    try:
        session = read_record(store, layout.SESSION, Session, retry_s=retry_s)
    except MalformedRecordError as exc:
        log.warning("ignoring an unreadable session record: %s", exc)
        return None
    if session is None or session.run_id != run_id or session.generation != generation:
        return None
    return session


def wait_for_session(
    store: Store, *, rank: int, token: str, run_id: str, generation: int, master_token: str,
    join_timeout_s: float, backoff: Backoff, progress_interval_s: float, retry_s: float,
    lease_s: float, clock: Clock | None = None, check: Callable[[], None] | None = None,
    exclude: str | None = None,
) -> Session:
    """Worker: wait for the master's session naming this daemon's token.

    The master's lease is watched meanwhile: a master that dies while the
    group forms is reported after one lease, not after the join timeout.  A
    session that names another incarnation of this rank (this daemon was
    restarted while the old group still ran) or is `exclude` (the session this
    daemon left to regroup) is not ours: the master forms a new one.
    """
    clock = clock or Clock()
    seen = [Seen(-1, clock.now(), master_token)]

    def probe() -> Session | None:
        hb = read_record(store, layout.heartbeat(0), Heartbeat, retry_s=retry_s)
        now = clock.now()
        news, seen[0] = master_before_group(hb, master_token, seen[0], now=now, lease_s=lease_s)
        if news is MasterNews.COMPLETED_BEFORE:
            # It finished without ever forming a group: restarted on a run its
            # journal had completed (coordinator/machine/finished.py), it exited at once.
            assert hb is not None
            raise RunCompleted(
                f"run {run_id} was already complete: the master (pid {hb.pid} on "
                f"{hb.host}), started again, found every iteration done, so rank {rank} "
                "has nothing to do")
        if news is MasterNews.COMPLETED:
            assert hb is not None
            raise RunCompleted(
                f"the master (pid {hb.pid} on {hb.host}) completed run {run_id} without "
                f"rank {rank}: nothing is left for it to do")
        if news is MasterNews.GAVE_UP:
            # It formed the group and stopped the run before this rank read the
            # session (a setting refused in phase 0): exit as its abort says.
            assert hb is not None
            raise master_gave_up(hb)
        if news is MasterNews.STOPPED:
            assert hb is not None
            raise PeerLostError(
                f"the master (pid {hb.pid} on {hb.host}) stopped before the group formed: "
                f"{hb.error or hb.state.value}", rank=0, host=hb.host)
        if news is MasterNews.SILENT:
            raise PeerLostError(
                f"the master's heartbeat has not advanced for {now - seen[0].at:.1f} s "
                f"(lease {lease_s:g} s) while the group formed: is it still running?", rank=0)
        if news is not MasterNews.SESSION:
            return None
        assert hb is not None and hb.session is not None
        session = read_record(store, layout.SESSION, Session, retry_s=retry_s)
        if not session_is_ours(session, announced=hb.session, run_id=run_id,
                               generation=generation, exclude=exclude, rank=rank, token=token):
            return None
        return session

    return Wait(
        deadline_s=join_timeout_s, backoff=backoff, progress_interval_s=progress_interval_s,
        describe=lambda: "the master to form the group (it waits for every rank to join)",
        clock=clock, check=check,
    ).until(probe)
