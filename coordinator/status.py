"""`coordinator status`: what every rank is doing, read from the run directory.

Liveness here is for humans: one sample compares each heartbeat's wall time
with this host's clock (NTP-synchronised clusters agree to well under a
lease), and `--watch`-style sampling (`window_s > 0`) reads twice and checks
whether the counters advanced, which needs no clock agreement at all and is
what `recover` and `run --new-run` use before touching anything.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from pathlib import Path
from typing import Any

from coordinator import layout
from coordinator.errors import MalformedRecordError
from coordinator.liveness import describe_phase
from coordinator.records import Claim, Heartbeat, Manifest, NodeState, Release, Session
from coordinator.store import FsStore, Store, read_record


class RankState(str, enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"
    STARTING = "starting"
    LOST = "lost"
    LEFT = "left"
    FAILED = "failed"
    FINISHED = "finished"
    ABSENT = "absent"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankView:
    rank: int
    state: RankState
    host: str = "-"
    address: str = "-"
    pid: int | None = None
    iteration: int | None = None
    phase: int | None = None
    heartbeat_age_s: float | None = None
    advancing: bool | None = None
    waiting_for: str = ""
    error: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatusReport:
    log_path: Path
    manifest: Manifest | None
    session: Session | None
    ranks: tuple[RankView, ...]
    last_error: str | None

    def live(self) -> list[RankView]:
        return [r for r in self.ranks if r.advancing or (
            r.advancing is None and r.state in (RankState.RUNNING, RankState.WAITING,
                                                RankState.STARTING))]

    def to_json(self) -> dict[str, Any]:
        return {
            "log_path": str(self.log_path),
            "run_id": self.manifest.run_id if self.manifest else None,
            "generation": self.manifest.generation if self.manifest else None,
            "num_nodes": self.manifest.num_nodes if self.manifest else None,
            "session": dataclasses.asdict(self.session) if self.session else None,
            "ranks": [
                {**dataclasses.asdict(r), "state": r.state.value} for r in self.ranks
            ],
            "last_error": self.last_error,
        }


def _safe(store: Store, key: str, cls: type[Any]) -> Any:
    try:
        return read_record(store, key, cls, retry_s=0.5)
    except MalformedRecordError:
        return None


def collect(log_path: Path, *, window_s: float = 0.0, lease_s: float | None = None) -> StatusReport:
    store = FsStore(log_path)
    manifest: Manifest | None = _safe(store, layout.MANIFEST, Manifest)
    session: Session | None = _safe(store, layout.SESSION, Session)
    if manifest is None:
        return StatusReport(log_path=log_path, manifest=None, session=None, ranks=(),
                            last_error=None)
    lease = lease_s or float(manifest.config.get("coordination", {}).get("lease_s", 15.0))
    ranks = range(manifest.num_nodes)
    first = {r: _safe(store, layout.heartbeat(r), Heartbeat) for r in ranks}
    second = first
    if window_s > 0:
        time.sleep(window_s)
        second = {r: _safe(store, layout.heartbeat(r), Heartbeat) for r in ranks}
    views = []
    now = time.time()
    for r in ranks:
        claim: Claim | None = _safe(store, layout.claim(r), Claim)
        hb: Heartbeat | None = second[r]
        if hb is None or hb.run_id != manifest.run_id:
            views.append(RankView(rank=r, state=RankState.ABSENT,
                                  host=claim.host if claim else "-"))
            continue
        before = first[r]
        advancing = None
        if window_s > 0:
            advancing = before is not None and before.token == hb.token and \
                hb.counter != before.counter
        age = max(0.0, now - hb.wall_time)
        state = RankState(hb.state.value)
        live = state in (RankState.RUNNING, RankState.WAITING, RankState.STARTING)
        if live and (advancing is False or (advancing is None and age > lease)):
            state = RankState.LOST
        views.append(RankView(
            rank=r, state=state, host=hb.host,
            address=claim.address if claim and claim.token == hb.token else "-",
            pid=hb.pid, iteration=hb.iteration, phase=hb.phase, heartbeat_age_s=age,
            advancing=advancing, waiting_for=hb.waiting_for, error=hb.error,
        ))
    return StatusReport(log_path=log_path, manifest=manifest, session=session,
                        ranks=tuple(views), last_error=_last_error(store, first, second))


def _last_error(store: Store, *samples: dict[int, Heartbeat | None]) -> str | None:
    master = samples[-1].get(0)
    if master is not None and master.abort is not None:
        return master.abort.reason
    if master is not None and master.released is not None:
        release = _safe(store, layout.release(*master.released), Release)
        if release is not None and release.abort is not None:
            return release.abort.reason
    for hb in samples[-1].values():
        if hb is not None and hb.state in (NodeState.FAILED, NodeState.LEFT) and hb.error:
            return f"rank {hb.rank}: {hb.error}"
    return None


def render(report: StatusReport) -> str:
    """The table `coordinator status` prints."""
    from rich.console import Console
    from rich.table import Table

    if report.manifest is None:
        return f"no run in {report.log_path} (no run.json): nothing has started there yet"
    m = report.manifest
    title = f"run {m.run_id} generation {m.generation} in {report.log_path}"
    if report.session:
        title += (f" - iterations {report.session.start_iteration}.."
                  f"{report.session.end_iteration - 1}")
    table = Table(title=title)
    for column in ("rank", "host", "address", "iteration", "phase", "state", "heartbeat",
                   "waiting for"):
        table.add_column(column)
    for r in report.ranks:
        table.add_row(
            str(r.rank), r.host, r.address,
            "-" if r.iteration is None else str(r.iteration),
            "-" if r.phase is None else describe_phase(r.phase),
            r.state.value,
            "-" if r.heartbeat_age_s is None else f"{r.heartbeat_age_s:.1f} s ago",
            r.waiting_for or (r.error or ""),
        )
    console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    if report.last_error:
        console.print(f"last error: {report.last_error}")
    return console.export_text()


def render_json(report: StatusReport) -> str:
    return json.dumps(report.to_json(), indent=2)
