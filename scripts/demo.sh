#!/usr/bin/env bash
# Install what the demo needs (scripts/setup.sh: the project and its runtime
# dependencies, no test tools) and run it: 3 simulated nodes on this machine,
# the tiny local model, the built-in task, the hf engine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/coordinator demo "$@"
