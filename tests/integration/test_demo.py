"""`coordinator demo --engine vllm --arch qwen2` end to end: 2 simulated nodes, 2
iterations on vLLM's CPU build (.venv-vllm, installed by scripts/setup_test.sh), its
table and its PNG.

This is also the real loop on vLLM, on a model of a real architecture (Qwen2's,
tiny size: byte-level BPE, ChatML template, bf16 weights served in float32): the
built-in task goes through the chat template, phase 7 puts each engine to sleep
(on CPU vLLM pauses its scheduler and keeps the weights), phase 12 reloads the new
bf16 checkpoint into the same process, verified by probes, and the model learns.
The tiny character model's daemons on the hf engine run in
tests/integration/test_usage_line.py."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rollout.train_batch import load_train_batch
from tests.integration.usage import assert_reloaded_in_place
from tests.rollout.test_vllm_real import VLLM
from trainer.local_copy import copy_to_local_cache
from trainer.manifest import read_manifest

# 80-99 s on 2 idle cores; the suite's 300 s is too little on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_demo_on_vllm_trains_two_nodes_reloading_in_place_and_draws_its_reward_curve(
    tmp_path: Path,
) -> None:
    assert VLLM.exists(), f"{VLLM} is missing: scripts/setup_test.sh installs it"
    run = tmp_path / "demo"
    # The demo's own temporary directory (the node-local caches, vLLM's rendezvous
    # files): what it leaves there is its own, whatever the suite's other workers run.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # Measured 80 s on the 2-core machine, 37 s of it the two engines starting.
    done = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "demo", "--run-dir", str(run), "--nodes", "2",
         "--iterations", "2", "--eval-interval", "1", "--engine", "vllm", "--vllm", str(VLLM),
         "--arch", "qwen2"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "coordinator demo: per iteration" in out
    assert "runs on cpu: sleep mode not available" in out
    table = [line for line in out.splitlines() if line.startswith("│")]
    rows = [cells for line in table
            if (cells := [c.strip() for c in line.strip("│").split("│")])[0] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"], out[-4000:]
    header = next(line for line in out.splitlines() if line.startswith("┃ iter"))
    assert [c.strip() for c in header.strip("┃").split("┃")][4:6] == ["samples", "failed"]
    for cells in rows:
        assert int(cells[4]) == 128 * 8 and int(cells[5]) == 0  # samples trained, failed
        assert float(cells[-1]) > 0.0  # its seconds
    rewards = [float(cells[1]) for cells in rows]
    assert rewards[1] > rewards[0], rewards  # 0.110 -> 0.148 measured
    assert float(rows[1][2]) >= 0.0  # eval accuracy, evaluated with --eval-interval 1
    assert "2 nodes, 2 iterations in" in out
    png = run / "reward-curve.png"
    header_bytes = png.read_bytes()[:24]
    assert header_bytes[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header_bytes[16:24])
    assert (width, height) == (600, 350)  # figsize 6 x 3.5 in at 100 dpi
    assert f"reward curve: {png}" in out
    assert_reloaded_in_place(run, ranks=2)  # the vLLM engines stayed up
    # A Qwen2 model in bf16, prompted through its chat template, published in bf16.
    assert json.loads((run / "model-init/config.json").read_text())["model_type"] == "qwen2"
    # Iteration 1's checkpoint is a delta of iteration 0's (checkpoint.full_every):
    # made whole as a node makes it.
    published = run / "checkpoints/iter-000001"
    assert read_manifest(published).delta is not None
    whole = copy_to_local_cache(published, tmp_path / "node-cache")
    weights = load_file(whole / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    batch = load_train_batch(run / "iterations/000001/batch.pt")
    assert {ids[0] for ids in batch.prompt_ids} == {1}  # <|im_start|>: the template's
    bound = []
    for rank in range(2):
        log = (run / f"ranks/{rank}/logs/vllm_server.log").read_text()
        assert "--enable-sleep-mode" not in log  # vLLM's CPU build refuses it
        # Each engine computes on its own share of the machine's cores (left to
        # choose, both bound the same one: 59 s to ready instead of 37 s).
        found = re.search(r"core ids=\[([\d, ]+)\]", log)
        assert found, log[-2000:]
        bound.append({int(c) for c in found[1].split(",")})
    if len(os.sched_getaffinity(0)) >= 2:
        assert not bound[0] & bound[1], bound
    # Nothing left behind: no process of this run (vLLM serves the run's node-local
    # copy, named by the run id), no rendezvous file.
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    leftovers = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                 if any(run_id in arg or str(run) in arg for arg in p.info["cmdline"] or [])]
    assert leftovers == []
    assert not list(tmp.glob("vllm_dist_*"))
    # Nor the node-local cache of the run (the last daemon out removes it).
    assert f"to serve {tmp}/coordinator-" in (run / "demo-logs/rank-0.log").read_text()
    assert not list(tmp.glob(f"coordinator-*/{run_id}"))
    # A normal finish says nothing at WARNING or above.
    for rank in range(2):
        lines = (run / f"demo-logs/rank-{rank}.log").read_text().splitlines()
        loud = [line for line in lines if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]
        assert loud == [], loud
