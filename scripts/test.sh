#!/usr/bin/env bash
# Install the project with every test tool (scripts/setup_test.sh) and run the
# whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_test.sh
exec .venv/bin/python -m pytest -q "$@"
