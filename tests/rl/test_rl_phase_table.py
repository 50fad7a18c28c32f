"""Every phase has exactly one function in rl/ doing its work, as rl/__init__.py's table says."""

from __future__ import annotations

import rl
from coordinator.records.phases import Phase
from rl.actions import PHASE_WORK


def _name(fn: object) -> str:
    module = getattr(fn, "__module__", "").removeprefix("rl.")
    return f"`{module}.{getattr(fn, '__qualname__', '?')}`"


def test_the_phase_table_in_the_package_docstring_matches_phase_work() -> None:
    doc = rl.__doc__ or ""
    body = doc.split("<!-- rl-phases:start -->")[1].split("<!-- rl-phases:end -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in body.strip().splitlines()[2:]]
    expected = [[f"{int(p)} {p.name.lower()}", _name(PHASE_WORK[p].run),
                 _name(PHASE_WORK[p].decide) if PHASE_WORK[p].decide else "-"] for p in Phase]
    assert rows == expected


def test_each_phase_has_its_own_work_function() -> None:
    runs = [PHASE_WORK[p].run for p in Phase]
    assert len(set(runs)) == len(runs) == 14
    for phase in Phase:
        assert PHASE_WORK[phase].run.__module__.startswith("rl.")
