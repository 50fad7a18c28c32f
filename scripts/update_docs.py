"""Rewrite the tables of docs/PROTOCOL.md that are generated from the code.

    python scripts/update_docs.py          rewrite them in place
    python scripts/update_docs.py --check  exit 1 when one is out of date

Each table sits between `<!-- NAME:start -->` and `<!-- NAME:end -->`;
tests/coordinator/test_protocol_doc.py runs the check.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.config import on_failure  # noqa: E402
from coordinator.config.run_config import CoordinationConfig, to_plain  # noqa: E402
from coordinator.config.settings import iter_settings  # noqa: E402
from rl import run_layouts  # noqa: E402
from rollout.engines import weight_updates  # noqa: E402

DOC = ROOT / "docs" / "PROTOCOL.md"


def timeouts_table() -> str:
    """Every [coordination] setting with its default and meaning, from its declaration."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}` | {to_plain(default)} | {declared.help} |"
             for key, declared, _, default in iter_settings(CoordinationConfig, "coordination")]
    return "\n".join(rows)


def node_local_table() -> str:
    """The node-local keys of every registered action kind (declared node_local=True)."""
    from coordinator.machine.actions import kind, kind_names

    keys = [key for name in kind_names() for key in kind(name).node_local]
    return "\n".join(["| key |", "|---|", *(f"| `{key}` |" for key in keys)])


GENERATED: dict[str, Callable[[], str]] = {"on-failure": on_failure.markdown_table,
                                           "timeouts": timeouts_table,
                                           "node-local": node_local_table,
                                           "run-layouts": run_layouts.markdown_table,
                                           "weight-updates": weight_updates.markdown_table}


def render(text: str) -> str:
    for marker, make in GENERATED.items():
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        if start not in text or end not in text:
            raise SystemExit(f"{DOC}: no {start} ... {end} block to fill")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{make()}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/update_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
