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
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from coordinator import routing
from coordinator.config.run_config import CoordinationConfig
from coordinator.errors import MalformedRecordError, UsageError
from coordinator.machine import daemon_log
from coordinator.machine.actions import kind
from coordinator.machine.liveness import describe_phase
from coordinator.machine.regroup import Recovery, RecoveryLog
from coordinator.records import layout
from coordinator.records.records import (
    LIVE_STATES,
    Claim,
    Heartbeat,
    Manifest,
    NodeState,
    Release,
    Session,
)
from coordinator.storage.store import FsStore, Store, read_record

if TYPE_CHECKING:
    from rich.text import Text


class RankState(str, enum.Enum):
    RUNNING = "running"
    WAITING = "waiting"
    STEP_FAILED = "step-failed"
    REGROUPING = "regrouping"
    STARTING = "starting"
    LOST = "lost"
    LEFT = "left"
    FAILED = "failed"
    FINISHED = "finished"
    ABSENT = "absent"


_LIVE: Final = tuple(RankState(s.value) for s in LIVE_STATES)
# A window that sees every live rank beat again: its heartbeat interval and this much
# (a beat's write, a loaded node).
BEAT_SLACK_S: Final = 1.0


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
    run_dir: Path
    manifest: Manifest | None
    session: Session | None
    ranks: tuple[RankView, ...]
    last_error: str | None
    # Records that are corrupt, out of range or not plain files, each naming its path.
    problems: tuple[MalformedRecordError, ...] = ()
    recoveries: tuple[Recovery, ...] = ()  # automatic recoveries, oldest first
    # Per iteration, what the action kind reports (the RL loop: samples trained,
    # failed samples, reward) and the recoveries made in it.
    iterations: tuple[dict[str, Any], ...] = ()

    def live(self) -> list[RankView]:
        return [r for r in self.ranks if r.advancing or (
            r.advancing is None and r.state in _LIVE)]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": routing.display(self.run_dir),
            "run_id": self.manifest.run_id if self.manifest else None,
            "generation": self.manifest.generation if self.manifest else None,
            "num_nodes": self.manifest.num_nodes if self.manifest else None,
            "session": dataclasses.asdict(self.session) if self.session else None,
            "ranks": [
                {**dataclasses.asdict(r), "state": r.state.value,
                 "log": routing.display(daemon_log.path(self.run_dir, r.rank))}
                for r in self.ranks
            ],
            "last_error": self.last_error,
            "problems": [str(p) for p in self.problems],
            "recoveries": [r.to_json() for r in self.recoveries],
            "iterations": list(self.iterations),
        }


class _Reader:
    """Reads records for a report; a bad one is noted (with its path) and shown as absent."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.problems: dict[str, MalformedRecordError] = {}

    def __call__(self, key: str, cls: type[Any]) -> Any:
        try:
            return read_record(self.store, key, cls, retry_s=0.5)
        except MalformedRecordError as exc:
            self.problems.setdefault(key, exc)
            return None


def collect(run_dir: Path, *, window_s: float = 0.0, lease_s: float | None = None,
            iterations: bool = False) -> StatusReport:
    """Every rank's state; a corrupt run.json raises (nothing can be shown without it).
    With `iterations`, also what each iteration did (iteration_rows)."""
    store = FsStore(run_dir)
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=0.5)
    _safe = _Reader(store)
    session: Session | None = _safe(layout.SESSION, Session)
    if manifest is None:
        return StatusReport(run_dir=run_dir, manifest=None, session=None, ranks=(),
                            last_error=None, problems=tuple(_safe.problems.values()))
    coordination = manifest.config.get("coordination", {})
    defaults = CoordinationConfig()
    lease = lease_s or float(coordination.get("lease_s", defaults.lease_s))
    # A window shorter than a beat and its slack may see no new beat from a rank that
    # is alive: only a counter that moved is evidence then, one that did not is not.
    conclusive = window_s >= float(coordination.get(
        "heartbeat_interval_s", defaults.heartbeat_interval_s)) + BEAT_SLACK_S
    ranks = range(manifest.num_nodes)
    first = {r: _safe(layout.heartbeat(r), Heartbeat) for r in ranks}
    second = first
    if window_s > 0:
        time.sleep(window_s)
        second = {r: _safe(layout.heartbeat(r), Heartbeat) for r in ranks}
    views = []
    now = time.time()
    for r in ranks:
        claim: Claim | None = _safe(layout.claim(r), Claim)
        hb: Heartbeat | None = second[r]
        if hb is None or hb.run_id != manifest.run_id:
            views.append(RankView(rank=r, state=RankState.ABSENT,
                                  host=claim.host if claim else "-"))
            continue
        before = first[r]
        advancing = None
        if window_s > 0:
            moved = before is not None and before.token == hb.token and \
                hb.counter != before.counter
            advancing = True if moved else (False if conclusive else None)
        age = max(0.0, now - hb.wall_time)
        state = RankState(hb.state.value)
        live = state in _LIVE
        if live and (advancing is False or (advancing is None and age > lease)):
            state = RankState.LOST
        views.append(RankView(
            rank=r, state=state, host=hb.host,
            address=claim.address if claim and claim.token == hb.token else "-",
            pid=hb.pid, iteration=hb.iteration, phase=hb.phase, heartbeat_age_s=age,
            advancing=advancing, waiting_for=hb.waiting_for, error=hb.error,
        ))
    last_error = _last_error(_safe, first, second)
    history: RecoveryLog | None = _safe(layout.RECOVERIES, RecoveryLog)
    recoveries = history.recoveries if history and history.run_id == manifest.run_id else ()
    return StatusReport(run_dir=run_dir, manifest=manifest, session=session,
                        ranks=tuple(views), last_error=last_error,
                        problems=tuple(_safe.problems.values()), recoveries=recoveries,
                        iterations=iteration_rows(run_dir, manifest, recoveries)
                        if iterations else ())


def iteration_rows(run_dir: Path, manifest: Manifest,
                   recoveries: tuple[Recovery, ...]) -> tuple[dict[str, Any], ...]:
    """The action kind's row for each iteration it has metrics of, and for each
    iteration a recovery was made in, with that count under "recoveries"."""
    run = manifest.config.get("run", {})
    name = run.get("actions", "rl") if isinstance(run, dict) else "rl"
    total = run.get("iterations") if isinstance(run, dict) else None
    try:
        report = kind(str(name)).iteration_report
    except UsageError:  # an action kind this installation lacks: nothing to add
        report = None
    rows = {int(r["iteration"]): dict(r) for r in (
        report(run_dir, total) if report is not None and isinstance(total, int) else [])}
    made = Counter(r.iteration for r in recoveries)
    for it in made:
        rows.setdefault(it, {"iteration": it})
    for it, row in rows.items():
        row["recoveries"] = made.get(it, 0)
    return tuple(rows[it] for it in sorted(rows))


def _last_error(read: _Reader, *samples: dict[int, Heartbeat | None]) -> str | None:
    master = samples[-1].get(0)
    if master is not None and master.abort is not None:
        return master.abort.reason
    if master is not None and master.released is not None:
        release = read(layout.release(*master.released), Release)
        if release is not None and release.abort is not None:
            return release.abort.reason
    for hb in samples[-1].values():
        if hb is not None and hb.state in (NodeState.FAILED, NodeState.LEFT) and hb.error:
            return f"rank {hb.rank}: {hb.error}"
    return None


RECOVERIES_SHOWN: Final = 5
ITERATIONS_SHOWN: Final = 20  # the table; --json has every iteration
_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(text: object) -> Text:
    """Record text as inert terminal text: no escape sequences, no rich markup.

    Heartbeats are written by other hosts (or by whoever can write the run
    directory); an ESC byte in an error message must not reach the terminal.
    """
    from rich.text import Text

    escaped = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
    return Text(escaped)


def render(report: StatusReport) -> str:
    """The table `coordinator status` prints."""
    from rich.console import Console
    from rich.table import Table

    problems = [f"unreadable: {p}" for p in report.problems]
    if report.manifest is None:
        return "\n".join(plain(line).plain for line in [
            f"no run in {routing.display(report.run_dir)} (no run.json): nothing has started there yet",
            *problems])
    m = report.manifest
    title = f"run {m.run_id} generation {m.generation} in {routing.display(report.run_dir)}"
    if report.session:
        title += (f" - iterations {report.session.start_iteration}.."
                  f"{report.session.end_iteration - 1}")
        out = [r for r in range(m.num_nodes) if report.session.token_of(r) is None]
        if out and report.session.run_id == m.run_id:
            title += f" - going on without rank(s) {out} (on_failure shrink)"
    table = Table(title=plain(title))
    for column in ("rank", "host", "address", "iteration", "phase", "state", "heartbeat",
                   "waiting for"):
        table.add_column(column)
    for r in report.ranks:
        table.add_row(*(plain(cell) for cell in (
            str(r.rank), r.host, r.address,
            "-" if r.iteration is None else str(r.iteration),
            "-" if r.phase is None else describe_phase(r.phase),
            r.state.value,
            "-" if r.heartbeat_age_s is None else f"{r.heartbeat_age_s:.1f} s ago",
            r.waiting_for or (r.error or ""),
        )))
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    console.print(plain(f"each rank's log: {routing.display(report.run_dir)}/ranks/<R>/logs/"
                        f"{daemon_log.NAME} (its engine's and trainer's beside it)"))
    if report.iterations:
        console.print(_iterations_table(report.iterations))
    if report.recoveries:
        shown = report.recoveries[-RECOVERIES_SHOWN:]
        console.print(plain(f"automatic recoveries: {len(report.recoveries)}"
                            + (f" (the last {len(shown)})" if len(shown) < len(report.recoveries)
                               else "")))
        for recovery in shown:
            console.print(plain(f"  {recovery.describe()}"))
    if report.last_error:
        console.print(plain(f"last error: {report.last_error}"))
    for problem in problems:
        console.print(plain(problem))
    return console.export_text()


def _iterations_table(rows: tuple[dict[str, Any], ...]) -> Any:
    from rich.table import Table

    shown = rows[-ITERATIONS_SHOWN:]
    columns = list(dict.fromkeys(k for row in shown for k in row))
    table = Table(title="per iteration" + (f" (the last {len(shown)} of {len(rows)})"
                                           if len(shown) < len(rows) else ""))
    for column in columns:
        table.add_column(column.replace("_", " "))

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    for row in shown:
        table.add_row(*(plain(cell(row.get(c))) for c in columns))
    return table


def render_json(report: StatusReport) -> str:
    return json.dumps(report.to_json(), indent=2)


def stopped(report: StatusReport) -> bool:
    """Every rank of the run has stopped (finished, failed, left, or never came)."""
    return report.manifest is not None and not report.live() and all(
        r.state in (RankState.FINISHED, RankState.FAILED, RankState.LEFT, RankState.ABSENT,
                    RankState.LOST) for r in report.ranks)


def watch(run_dir: Path, *, interval_s: float, terminal: bool,
          echo: Callable[[str], None]) -> StatusReport:
    """`status --watch`: the table again every `interval_s` (each refresh watches the
    heartbeats advance for that long), until every daemon has stopped.  On a
    terminal the table is redrawn in place; otherwise each refresh is printed
    after a timestamp line, for a log file."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def refresh() -> tuple[StatusReport, str]:
        report = collect(run_dir, window_s=interval_s, iterations=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return report, f"{stamp} (refreshed every {interval_s:g} s)\n{render(report)}"

    report = collect(run_dir)
    if not terminal:
        while not stopped(report):
            report, text = refresh()
            echo(text)
        return report
    with Live(Text(""), console=Console(), auto_refresh=False) as live:
        while not stopped(report):
            report, text = refresh()
            live.update(Text(text), refresh=True)
    return report
