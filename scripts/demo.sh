#!/usr/bin/env bash
# Install everything (scripts/setup.sh) and run the demo: 3 simulated nodes on
# this machine, the tiny local model, the built-in task, the hf engine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/coordinator demo "$@"
