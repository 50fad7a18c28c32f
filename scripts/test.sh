#!/usr/bin/env bash
# Install the project with every test tool (scripts/setup_test.sh) and run the
# whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_test.sh
# Two pytest workers (pytest-xdist): the suite is mostly single-process waits and
# one-core work, 39 min in one process on 2 cores, 24 in two.  worksteal gives each
# worker half the suite in collection order and rebalances at the end; --dist load
# interleaved the multi-node scenarios two at a time and was slower (half the tests
# done after 20 min of testing, when worksteal had done nearly all).  Every test
# keeps what it checks inside its own tmp dir, and a test that stops a node at a
# point of its work gates it there (tests/support/reward_gate.py), never on a race
# with the machine's load.  TEST_WORKERS=0 runs one process; arguments after
# override these.
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal "$@"
