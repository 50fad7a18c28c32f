#!/usr/bin/env bash
# Create .venv and install what `coordinator` and its demo need: the project and
# its runtime dependencies, nothing more (scripts/demo.sh runs this).  The test
# tools come with scripts/setup_test.sh (scripts/test.sh runs that).
# Pins the local CPU build of torch first when none is installed: a bare
# `pip install torch` would pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e .
