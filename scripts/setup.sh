#!/usr/bin/env bash
# Create .venv and install what `coordinator` and its demo need: the project and
# its runtime dependencies, nothing more (scripts/demo.sh runs this).  The test
# tools come with scripts/setup_test.sh (scripts/test.sh runs that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# torch is pinned to the local CPU build when none is installed (a bare
# `pip install torch` would pull a multi-GB CUDA build on a CPU machine), in the
# same pip call as the project: one resolution, not two.  --no-compile: pip
# would byte-compile all 11,500 modules installed (about 30 s of CPU on the
# 2-core development machine), most never imported (transformers' hundreds of
# model families); the imports below compile what the demo's processes use.
if "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-compile -e .
else
  "$PY" -m pip install --quiet --no-compile "torch==2.13.0" -e .
fi
# What the demo's processes import (the CLI, the daemon's phases, the hf engine,
# the trainer, torchrun, the reports), compiled by importing it once; written
# even where PYTHONDONTWRITEBYTECODE is set, as pip's own compile would be, or
# each of the demo's dozen processes would compile torch again.
IMPORTED_BY_THE_DEMO="coordinator_cli.app rl.actions rl.demo rl.reporting rollout.hf.server trainer.resident
  trainer.warmstart torch.distributed.run torch.utils.tensorboard matplotlib.pyplot
  transformers.models.llama.modeling_llama"
# shellcheck disable=SC2086  # one argument per module name
env -u PYTHONDONTWRITEBYTECODE "$PY" -c \
  'import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]' \
  $IMPORTED_BY_THE_DEMO
