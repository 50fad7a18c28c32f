"""`coordinator timeline`: a Gantt chart of every rank's phases, from the timing records.

    iterations/<N>/timings/rank-<R>.json   (rank R, at the end of iteration N)
        per phase: action_s, wait_s, arrived_at, released_at
    --> one bar per (rank, iteration, phase): the action, from arrived_at -
        action_s to arrived_at, then the barrier wait to released_at (hatched)
    recoveries.json --> a red line where a failure was seen, a green one where
        the group resumed

PNG (matplotlib) or HTML (one self-contained page: an inline SVG whose bars
name their rank, iteration, phase and seconds on hover, and a table of each
iteration's slowest rank).  The times are wall times of the hosts that wrote
them: clusters run NTP, and the picture only needs them to agree to well
under a phase.  Timing files are read like every record (torn, foreign or
malformed ones are skipped and counted, never trusted).
"""

from __future__ import annotations

import dataclasses
import enum
import html
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from coordinator import routing
from coordinator.errors import MalformedRecordError, UsageError
from coordinator.machine.regroup import Recovery, read_log
from coordinator.records import layout
from coordinator.records.bounds import check_iteration
from coordinator.records.phases import Phase
from coordinator.records.records import Manifest
from coordinator.storage.store import FsStore, read_document, read_record

log = logging.getLogger(__name__)
FORMATS: Final = (".png", ".html")


class SpanKind(str, enum.Enum):
    ACTION = "action"  # the phase's work on this rank
    WAIT = "wait"  # then waiting at the barrier for the others


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span:
    rank: int
    iteration: int
    phase: int
    kind: SpanKind
    start: float  # wall time
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeline:
    run_id: str
    num_nodes: int
    spans: tuple[Span, ...]
    recoveries: tuple[Recovery, ...]
    skipped: int  # timing files that were malformed or from another run
    # Why recoveries.json could not be read ("" when it was, or is absent): then
    # `recoveries` is empty for want of the record, not for want of recoveries.
    recoveries_unread: str = ""

    @property
    def origin(self) -> float:
        return min(s.start for s in self.spans)

    def iteration_totals(self) -> dict[int, dict[int, float]]:
        """Per iteration, per rank: seconds of action (the work, without waiting)."""
        out: dict[int, dict[int, float]] = {}
        for s in self.spans:
            if s.kind == SpanKind.ACTION:
                out.setdefault(s.iteration, {}).setdefault(s.rank, 0.0)
                out[s.iteration][s.rank] += s.seconds
        return out


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return float(value)


def _spans(raw: bytes, path: Path, *, run_id: str, rank: int, iteration: int) -> list[Span]:
    body = json.loads(raw)
    if not isinstance(body, dict) or body.get("schema") != "coordinator/timings" or \
            body.get("run_id") != run_id or body.get("rank") != rank or \
            body.get("iteration") != iteration or not isinstance(body.get("phases"), dict):
        raise MalformedRecordError(path, "not a timings record of this run, rank and iteration")
    spans = []
    for key, t in body["phases"].items():
        phase = int(key)
        if not 0 <= phase < len(Phase) or not isinstance(t, dict):
            raise MalformedRecordError(path, f"phase {key!r} is not a phase's timing")
        arrived, released = _number(t["arrived_at"]), _number(t["released_at"])
        action, wait = max(0.0, _number(t["action_s"])), max(0.0, _number(t["wait_s"]))
        spans.append(Span(rank=rank, iteration=iteration, phase=phase, kind=SpanKind.ACTION,
                          start=arrived - action, end=arrived))
        spans.append(Span(rank=rank, iteration=iteration, phase=phase, kind=SpanKind.WAIT,
                          start=arrived, end=max(arrived, released, arrived + wait)))
    return spans


def load(run_dir: Path) -> Timeline:
    """Every rank's timing records of the run in `run_dir`."""
    store = FsStore(run_dir)
    manifest = read_record(store, layout.MANIFEST, Manifest, retry_s=2.0)
    if manifest is None:
        raise UsageError(f"--run-dir {routing.display(run_dir)} holds no run (no run.json): nothing to draw")
    spans: list[Span] = []
    skipped = 0
    # A listing is a hint (PROTOCOL.md rule 4): enough for a picture drawn after the fact.
    for name in sorted(store.listdir(layout.ITERATIONS)):
        number = layout.iteration_named(name)
        if number is None:
            continue
        iteration = check_iteration(number)
        for rank in range(manifest.num_nodes):
            path = run_dir / layout.timings(iteration, rank)

            def parse(raw: bytes, where: Path, r: int = rank, i: int = iteration) -> list[Span]:
                return _spans(raw, where, run_id=manifest.run_id, rank=r, iteration=i)

            try:
                found = read_document(path, parse, retry_s=0.5)
            except (MalformedRecordError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping %s: %s", path, exc)
                skipped += 1
                continue
            spans.extend(found or [])
    if not spans:
        raise UsageError(f"run {manifest.run_id} in {routing.display(run_dir)} has no timing records yet: each "
                         "rank writes one when it completes an iteration")
    unread = ""
    try:
        recoveries = read_log(store, manifest.run_id, retry_s=2.0).recoveries
    except MalformedRecordError as exc:
        log.warning("drawing no recoveries: %s", exc)
        recoveries, unread = (), str(exc)
    return Timeline(run_id=manifest.run_id, num_nodes=manifest.num_nodes, spans=tuple(spans),
                    recoveries=recoveries, skipped=skipped, recoveries_unread=unread)


def write(timeline: Timeline, out: Path) -> None:
    if out.suffix not in FORMATS:
        raise UsageError(f"--out {out}: give a file ending in {' or '.join(FORMATS)}")
    if out.suffix == ".png":
        _write_png(timeline, out)
    else:
        out.write_text(_html(timeline))


def _colors(n: int) -> list[str]:
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps["tab20"]
    return [to_hex(cmap(i % 20)) for i in range(n)]


def _write_png(timeline: Timeline, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = _colors(len(Phase))
    origin = timeline.origin
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.55 * timeline.num_nodes))
    for s in timeline.spans:
        y = timeline.num_nodes - 1 - s.rank
        if s.kind == SpanKind.ACTION:
            ax.broken_barh([(s.start - origin, s.seconds)], (y - 0.35, 0.7),
                           facecolors=colors[s.phase], edgecolor="none")
        else:
            ax.broken_barh([(s.start - origin, s.seconds)], (y - 0.12, 0.24),
                           facecolors="#d0d0d0", edgecolor="none", hatch="///")
    for it, first in _iteration_starts(timeline.spans).items():
        ax.axvline(first - origin, color="#888888", linewidth=0.6, linestyle=":")
        ax.text(first - origin, timeline.num_nodes - 0.45, f"it {it}", fontsize=7, color="#555")
    for r in timeline.recoveries:
        ax.axvline(r.detected_at - origin, color="red", linewidth=1.2)
        ax.axvline(r.resumed_at - origin, color="green", linewidth=1.2)
        ax.text(r.detected_at - origin, -0.9, f"recovery {r.number}: rank {r.rank}",
                fontsize=7, color="red")
    ax.set_yticks(range(timeline.num_nodes),
                  [f"rank {timeline.num_nodes - 1 - i}" for i in range(timeline.num_nodes)])
    ax.set_ylim(-1.2, timeline.num_nodes - 0.2)
    ax.set_xlabel("seconds since the first recorded phase")
    ax.set_title(f"run {timeline.run_id}: phases per rank (bars: action; hatched: barrier wait)")
    legend = [Patch(facecolor=colors[p], label=p.label) for p in Phase]
    legend.append(Patch(facecolor="#d0d0d0", hatch="///", label="barrier wait"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _iteration_starts(spans: Sequence[Span]) -> dict[int, float]:
    starts: dict[int, float] = {}
    for s in spans:
        starts[s.iteration] = min(starts.get(s.iteration, s.start), s.start)
    return dict(sorted(starts.items()))


def _html(timeline: Timeline) -> str:
    colors = _colors(len(Phase))
    origin = timeline.origin
    end = max(s.end for s in timeline.spans)
    width, row, left = 1200.0, 34.0, 70.0
    scale = (width - left - 10) / max(end - origin, 1e-9)
    height = row * (timeline.num_nodes + 1) + 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}"'
             ' font-family="sans-serif" font-size="11">']
    for rank in range(timeline.num_nodes):
        parts.append(f'<text x="4" y="{row * rank + 22:.0f}">rank {rank}</text>')
    for s in timeline.spans:
        x = left + (s.start - origin) * scale
        w = max(s.seconds * scale, 0.5)
        action = s.kind == SpanKind.ACTION
        y = row * s.rank + (6 if action else 12)
        h = 22 if action else 10
        fill = colors[s.phase] if action else "#cccccc"
        tip = (f"rank {s.rank} iteration {s.iteration} phase {s.phase} "
               f"({Phase(s.phase).label}): {s.kind.value} {s.seconds:.3f} s")
        parts.append(f'<rect x="{x:.2f}" y="{y:.0f}" width="{w:.2f}" height="{h}" '
                     f'fill="{fill}"><title>{html.escape(tip)}</title></rect>')
    for it, first in _iteration_starts(timeline.spans).items():
        x = left + (first - origin) * scale
        parts.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="0" y2="{height - 20:.0f}" '
                     f'stroke="#888" stroke-dasharray="2,3"/><text x="{x + 2:.2f}" '
                     f'y="{height - 6:.0f}" fill="#555">it {it}</text>')
    for r in timeline.recoveries:
        for at, color in ((r.detected_at, "red"), (r.resumed_at, "green")):
            x = left + (at - origin) * scale
            parts.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="0" y2="{height - 20:.0f}" '
                         f'stroke="{color}"><title>{html.escape(r.describe())}</title></line>')
    parts.append("</svg>")
    legend = "".join(f'<span style="background:{colors[p]};padding:2px 6px;margin:2px;'
                     f'display:inline-block">{html.escape(p.label)}</span>'
                     for p in Phase)
    rows = []
    # A rank publishes its timings when it completes an iteration: one a recovery
    # resumed counts only the work after it (phases done before are skipped, ~0 s).
    resumed: dict[int, list[int]] = {}
    for r in timeline.recoveries:
        resumed.setdefault(r.resume_iteration, []).append(r.number)
    for it, per_rank in sorted(timeline.iteration_totals().items()):
        slowest = max(per_rank, key=lambda r: per_rank[r])
        red = ' style="color:#b00"'
        cells = "".join(f"<td{red if r == slowest else ''}>{per_rank[r]:.2f} s</td>"
                        if r in per_rank else "<td>-</td>" for r in range(timeline.num_nodes))
        note = (f" (resumed by recovery {', '.join(map(str, resumed[it]))}: only the work "
                "after it is counted)" if it in resumed else "")
        rows.append(f"<tr><td>{it}{note}</td>{cells}<td>rank {slowest}</td></tr>")
    head = "".join(f"<th>rank {r}</th>" for r in range(timeline.num_nodes))
    recoveries = "".join(f"<li>{html.escape(r.describe())}</li>" for r in timeline.recoveries)
    if timeline.recoveries_unread:
        recoveries = (f"<li>unknown: recoveries.json could not be read "
                      f"({html.escape(timeline.recoveries_unread)})</li>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>timeline of run "
            f"{html.escape(timeline.run_id)}</title></head><body style='font-family:sans-serif'>"
            f"<h2>run {html.escape(timeline.run_id)}: phases per rank</h2>"
            f"<p>Tall bars: the action; thin grey bars: waiting at the barrier. Hover a bar "
            f"for its rank, iteration, phase and seconds.</p>{''.join(parts)}<p>{legend}</p>"
            f"<h3>Action seconds per iteration (slowest rank in red)</h3><table border='1' "
            f"cellpadding='3'><tr><th>iteration</th>{head}<th>straggler</th></tr>"
            f"{''.join(rows)}</table><h3>Recoveries</h3><ul>{recoveries or '<li>none</li>'}"
            f"</ul><p>{timeline.skipped} unreadable timing file(s) skipped.</p></body></html>")
