#!/usr/bin/env bash
# What the test suite needs beyond scripts/setup.sh's .venv (scripts/test.sh
# runs this): the dev extra, vLLM's CPU build, SkyPilot, and the system tools
# of the filesystem, launch and bucket tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/setup.sh
# pytest, hypothesis, ruff, mypy, and the servers and clients the tests talk to.
.venv/bin/python -m pip install --quiet -e ".[dev]"
# vLLM's CPU build, in .venv-vllm: the tests run the vllm engine against it.
scripts/setup_vllm.sh
# SkyPilot, in .venv-sky: its own parser checks examples/launch/skypilot.yaml
# (tests/project/test_launch_recipes.py).  An environment of its own because
# its dependencies are not the project's; about 50 s and 460 MB.
if ! .venv-sky/bin/python -c "import sky" 2>/dev/null; then
  "$PYTHON" -m venv .venv-sky
  .venv-sky/bin/python -m pip install --quiet "skypilot==0.14.1"
fi
# System tools for the network-filesystem test fixture (sshfs over sshd on
# loopback, two FUSE mounts with their own caches). Installed when missing
# and we are root with apt; the fixture test fails with the reason otherwise.
# Slurm and munge for the launch recipe's tests: a real three-node cluster on
# this host (tests/support/slurm.py), started by the tests, never as a service.
# rclone for an object-store FUSE mount the run command must refuse
# (tests/support/rclone.py).
if ! command -v sshfs >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ] || \
    [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ] || \
    ! command -v rclone >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      sshfs openssh-server fuse3 slurmctld slurmd slurm-client munge rclone >/dev/null
  fi
fi
# Azurite, Microsoft's Azure Storage emulator, for the bucket tests
# (tests/support/buckets.py): npm's package, pinned, in .tools/azurite; node and
# npm from Debian when missing.  moto's S3 server comes with the dev extra.
if [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ]; then
  if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
  npm install --silent --no-audit --no-fund --prefix .tools/azurite azurite@3.35.0 >/dev/null
fi
