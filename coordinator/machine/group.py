"""Forming the group: the session that every daemon of a run works in.

    master   waits for every rank out of any session (a claim and a heartbeat
             seen advancing in state starting or regrouping), then publishes
             session.json with a fresh id, the members' tokens and the
             iteration to start at (the lowest one a member has not completed)
    worker   at start: waits for a session naming its token; after a regroup
             (regroup.py): waits for a live master first (the same one, or a
             restarted one), then for a session that is not the one it left

A group formed after a failure (the master regrouping, or a restarted master
finding its workers regrouping) is a recovery: recorded in recoveries.json
before the session is published.  The waits use join_timeout_s at start and
rejoin_timeout_s after a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from coordinator import routing
from coordinator.config.on_failure import policy
from coordinator.config.run_config import CoordinationConfig
from coordinator.errors import MalformedRecordError, PeerLostError, WaitTimeout
from coordinator.machine import membership, regroup
from coordinator.machine.decisions import Quorum
from coordinator.machine.liveness import HeartbeatPublisher
from coordinator.machine.polling import Backoff, Clock
from coordinator.machine.runtime import Runtime
from coordinator.records import layout
from coordinator.records.phases import Phase
from coordinator.records.records import Claim, Heartbeat, Manifest, NodeState, Session
from coordinator.storage.store import Store, read_record

log = logging.getLogger("coordinator")


@dataclasses.dataclass(kw_only=True)
class GroupForming:
    """What a daemon needs to form or join a session."""

    store: Store
    manifest: Manifest
    coord: CoordinationConfig
    rank: int
    token: str
    host: str
    run_dir: Path
    phases: Sequence[Phase]
    iterations: int
    heartbeat: HeartbeatPublisher
    runtime: Runtime
    backoff: Backoff
    clock: Clock

    # -- master ---------------------------------------------------------------
    def form(self, history: regroup.RecoveryLog, *, incident: regroup.Incident | None,
             started: float | None, previous: Heartbeat | None, admit: bool = False,
             ) -> tuple[Session, dict[int, str], regroup.RecoveryLog]:
        """Publish a new session once every rank is in; returns it, the hosts and the
        recovery log (with this recovery appended, if it is one).

        `incident`: this master regroups after it.  `previous`: the last heartbeat
        of the master incarnation this one replaced, when it did not finish.
        `admit`: a shrunk group takes back the ranks that returned, at an
        iteration boundary (no failure: nothing is recorded).
        """
        rejoin = incident is not None or previous is not None or admit
        run_id = self.manifest.run_id
        # The last session of this run, of any generation: `coordinator recover`
        # bumps the generation but keeps session.json, whose members say which
        # ranks the group had gone on with (a rank left out must not pull it
        # back into iterations completed without it: regroup.start_iteration).
        carried = self._last_session()
        left = carried if carried is not None and \
            carried.generation == self.manifest.generation else None

        quorum = self._quorum(after_failure=incident is not None or previous is not None,
                              admit=admit, left=left)
        why = (incident.cause if incident else "the shrunk group takes back the ranks that "
               "returned" if admit else "a restart of the master")
        # The deadline gather_members enforces: with a quorum, the group forms with the
        # ranks back by then (or fails naming the rule), without one it gives up.
        until = (f"waiting up to {quorum.after_s:g} s, then going on with the ranks back, "
                 f"at least {quorum.nodes} ({quorum.rule})" if quorum is not None
                 else f"waiting up to {self.coord.rejoin_timeout_s:g} s")

        def waiting(missing: list[int]) -> str:
            return (f"rank(s) {missing} to rejoin run {run_id} after: {why} (restart each with "
                    f"its original `coordinator run` command; {until})")

        try:
            claims, beats = membership.gather_members(
                self.store, run_id=run_id, generation=self.manifest.generation,
                num_nodes=self.manifest.num_nodes, own=self.heartbeat.record,
                join_timeout_s=self.coord.rejoin_timeout_s if rejoin
                else self.coord.join_timeout_s, lease_s=self.coord.lease_s,
                backoff=self.backoff, progress_interval_s=self.coord.progress_interval_s,
                retry_s=self.coord.read_retry_s, clock=self.clock, check=self.runtime.check,
                describe_wait=waiting if rejoin else None, quorum=quorum,
            )
        except WaitTimeout as exc:
            if not rejoin:
                raise
            raise regroup.rejoin_timeout("a rank", self.coord.rejoin_timeout_s) from exc
        start = regroup.start_iteration(beats, carried)
        later = () if admit else self._rejoin_later(beats, carried, start)
        if later:
            log.warning("rank(s) %s rejoin the group at the end of iteration %d: the others "
                        "worked on it without them (on_failure shrink), and its collective "
                        "step would otherwise run again on every rank", list(later), start)
            claims = {r: c for r, c in claims.items() if r not in later}
        members = {0: self.token} | {r: c.token for r, c in claims.items()}
        hosts = {0: self.host} | {r: c.host for r, c in claims.items()}
        if incident is None and not admit:
            incident = regroup.incident_from_members(beats, previous)
        if incident is not None:
            history = self._record(history, incident, started, start, hosts)
        session = Session(
            run_id=run_id, generation=self.manifest.generation, session=secrets.token_hex(8),
            start_iteration=start, end_iteration=max(start, self.iterations),
            members={str(r): t for r, t in members.items()},
        )
        membership.publish_session(self.store, session)
        self.heartbeat.update(session=session.session, state=NodeState.RUNNING, abort=None,
                              error=None, waiting_for="")
        log.info("group formed: ranks %s on hosts %s; iterations %d..%d", sorted(members),
                 [hosts[r] for r in sorted(hosts)], session.start_iteration,
                 session.end_iteration - 1)
        return session, hosts, history

    def _rejoin_later(self, beats: Mapping[int, Heartbeat], carried: Session | None,
                      start: int) -> tuple[int, ...]:
        """The ranks back that wait for the next iteration boundary (regroup.rejoin_later);
        the journals are read only when some rank back was not in the carried session."""
        if carried is None or all(carried.token_of(r) is not None for r in beats):
            return ()
        pending = regroup.pending_phases(
            self.store, [r for r in sorted(beats) if carried.token_of(r) is not None], start,
            self.phases, run_id=self.manifest.run_id, retry_s=self.coord.read_retry_s)
        return regroup.rejoin_later(sorted(beats), carried, pending=pending,
                                    phases=len(self.phases), min_nodes=self.coord.min_nodes)

    def _last_session(self) -> Session | None:
        try:
            found = read_record(self.store, layout.SESSION, Session,
                                retry_s=self.coord.read_retry_s)
        except MalformedRecordError as exc:
            log.warning("ignoring an unreadable session record: %s", exc)
            return None
        return found if found is not None and found.run_id == self.manifest.run_id else None

    def returning(self, session: Session) -> list[int]:
        """Master of a shrunk group, at an iteration boundary: the ranks out of the
        session that are back (a current claim, a heartbeat out of any session), to
        be taken back before the next iteration.  A hint: form(admit=True) checks
        that each is alive."""
        return [rank for rank in range(1, self.manifest.num_nodes)
                if session.token_of(rank) is None and membership.out_of_session(
                    self.store, rank, run_id=self.manifest.run_id,
                    generation=self.manifest.generation,
                    retry_s=self.coord.read_retry_s) is not None]

    def _quorum(self, *, after_failure: bool, admit: bool,
                left: Session | None) -> Quorum | None:
        """Whether this group may form without every rank: after a failure with
        on_failure "shrink", once shrink_after_s passed; when a shrunk group takes
        back returning ranks, as soon as they have had the time to show a live
        heartbeat (whoever is not back by then waits for the next boundary)."""
        coord = self.coord
        if admit and left is not None:
            return Quorum(nodes=len(left.members), rule="the shrunk group",
                                     after_s=coord.lease_s + 2 * coord.heartbeat_interval_s)
        if policy(coord.on_failure).shrinks and after_failure:
            return Quorum(nodes=coord.min_nodes, after_s=coord.shrink_after_s,
                                     rule=f"coordination.min_nodes={coord.min_nodes}")
        return None

    def _record(self, history: regroup.RecoveryLog, incident: regroup.Incident,
                started: float | None, start: int, hosts: dict[int, str]) -> regroup.RecoveryLog:
        now = time.time()
        return regroup.record(self.store, history, regroup.Recovery(
            number=len(history.recoveries) + 1, rank=incident.rank, host=incident.host,
            iteration=incident.iteration, phase=incident.phase, cause=incident.cause,
            detected_by=incident.detected_by, detected_at=incident.detected_at,
            resumed_at=now,
            resumed_after_s=time.monotonic() - started if started is not None
            else max(0.0, now - incident.detected_at),
            resume_iteration=start,
            pending=regroup.pending_phases(self.store, sorted(hosts), start, self.phases,
                                           run_id=self.manifest.run_id,
                                           retry_s=self.coord.read_retry_s),
            members={str(r): h for r, h in sorted(hosts.items())},
            left_out=tuple(r for r in range(self.manifest.num_nodes) if r not in hosts),
            fault=incident.fault))

    # -- worker ---------------------------------------------------------------
    def await_first(self, master_claim: Claim) -> Session:
        """At start: the session of the master found before the plan was made."""
        session = self._session(master_claim.token, timeout_s=self.coord.join_timeout_s,
                                exclude=None)
        self.heartbeat.update(state=NodeState.RUNNING, session=session.session)
        return session

    def rejoin(self, left: str, master_token: str) -> tuple[Session, str]:
        """After a regroup: a live master (this one or a restarted one), then a session
        other than `left`.  Returns it and the master's host."""
        deadline = time.monotonic() + self.coord.rejoin_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise regroup.rejoin_timeout("the group", self.coord.rejoin_timeout_s)
            # Each wait gets what is left of the one deadline; running out in either is
            # running out of rejoin_timeout_s, and is named so (not as the wait's share).
            try:
                # A master that gave up for good raises at once (PeerLostError): it ends
                # the wait; only a session that turned out stale sends us round again.
                info = membership.wait_for_master(
                    self.store, run_dir=routing.display(self.run_dir), join_timeout_s=remaining,
                    backoff=self.backoff, progress_interval_s=self.coord.progress_interval_s,
                    retry_s=self.coord.read_retry_s, probe_timeout_s=self.coord.probe_timeout_s,
                    clock=self.clock, check=self.runtime.check, gave_up_token=master_token)
                master_token = info.claim.token
                try:
                    session = self._session(master_token, exclude=left,
                                            timeout_s=max(deadline - time.monotonic(), 0.001))
                except PeerLostError as exc:
                    log.warning("rank %d: %s; waiting for a master again", self.rank, exc)
                    continue
            except WaitTimeout as exc:
                raise regroup.rejoin_timeout("the group", self.coord.rejoin_timeout_s) from exc
            self.heartbeat.update(state=NodeState.RUNNING, session=session.session, error=None,
                                  waiting_for="")
            return session, info.claim.host

    def _session(self, master_token: str, *, timeout_s: float, exclude: str | None) -> Session:
        return membership.wait_for_session(
            self.store, rank=self.rank, token=self.token, run_id=self.manifest.run_id,
            generation=self.manifest.generation, master_token=master_token,
            join_timeout_s=timeout_s, backoff=self.backoff,
            progress_interval_s=self.coord.progress_interval_s, retry_s=self.coord.read_retry_s,
            lease_s=self.coord.lease_s, clock=self.clock, check=self.runtime.check,
            exclude=exclude)
