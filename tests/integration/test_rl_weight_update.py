"""Phase 12's in-place weight update gone wrong on one node, in the real loop on 2 daemons.

The first two run on a model of a real architecture (Qwen2 shape, byte-level
BPE, ChatML template, bf16: trainer/architectures.py), the built-in task sent
through its chat template: the loop on the hf engine publishes bf16
checkpoints, and the probe check, scored on the weights as published, still
catches an engine that kept the old ones at the float32 tolerance.

The hf engine's fault hook (rollout/hf/control.py, ROLLOUT_HF_FAULTS) is set
in rank 1's environment only, as a broken engine would be on one node:

    reload "skip"            the engine answers the reload but keeps serving
                             the old weights (vLLM issue 32718): the probe
                             check names the node, every daemon exits 4
    reload "unreadable"      the reload fails: the node restarts its engine
                             on the checkpoint and the run completes
    ... + fail_start_from 2  the restart fails too: exit 4, naming the node
                             and quoting the engine's log
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rollout.hf.control import FAULTS_ENV
from tests.integration.test_rl_loop import CONFIG, LEASE
from tests.support.cluster import LocalCluster

pytestmark = pytest.mark.slow
FAULTY = 1
# Two daemons (one faulty, one healthy: enough to tell them apart), one iteration
# on the tiny model: ~20 s on 2 idle cores.
RUN_TIMEOUT_S = 400


def run_with_fault(tmp_path: Path, model: Path, fault: dict[str, object],
                   sleep_level: int = 2) -> tuple[LocalCluster, dict[int, int]]:
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(model=model, iterations=1, lease=LEASE, on_failure="exit")
                      + f"\n[engine]\nsleep_level = {sleep_level}\n")
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps(fault))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    try:
        for rank in range(2):
            c.start(rank, env={FAULTS_ENV: str(faults)} if rank == FAULTY else None)
        return c, c.wait_all(timeout=RUN_TIMEOUT_S)
    finally:
        c.close()


def phase12(c: LocalCluster, rank: int) -> dict:
    path = c.run_dir / f"iterations/000000/phase-12/arrive-{rank}.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_an_engine_serving_stale_weights_is_caught_naming_the_node(
        tmp_path: Path, warm_qwen2: Path) -> None:
    # Level 1 keeps the weights through sleep, so the skipped reload serves
    # iteration 0's policy instead of its checkpoint: a silent failure.
    c, codes = run_with_fault(tmp_path, warm_qwen2, {"reload": "skip"}, sleep_level=1)
    assert codes == {0: 4, 1: 4}, {r: c.output(r)[-2000:] for r in codes}
    text = c.output(0)
    assert re.search(rf"rank {FAULTY} on host \S+: the inference engine does not serve "
                     r"checkpoint iter-000000-\w+: .*differ from the trainer's by [\d.e-]+ on "
                     r"average \(tolerance 0\.002\)", text), text[-3000:]
    arrival = phase12(c, FAULTY)
    assert arrival["status"] == "failed" and "does not serve" in arrival["error"]
    # The healthy node is never blamed. Its own arrival is there, a success, when it
    # finished phase 12 before rank 1's failure stopped it; under load it may not
    # have (the master acts on a peer's failed step while its own still runs).
    assert not re.search(r"rank 0 on host \S+: the inference engine does not serve", text)
    if (c.run_dir / "iterations/000000/phase-12/arrive-0.json").exists():
        assert phase12(c, 0)["payload"]["engine"] == "reloaded"


def test_a_failed_reload_falls_back_to_a_restart_and_the_run_completes(
        tmp_path: Path, warm_qwen2: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rollout.train_batch import load_train_batch
    from trainer import train_state

    c, codes = run_with_fault(tmp_path, warm_qwen2, {"reload": "unreadable"})
    assert codes == {0: 0, 1: 0}, {r: c.output(r)[-2000:] for r in codes}
    # The built-in task went through the chat template; its answers end at the end of turn.
    tokenizer = AutoTokenizer.from_pretrained(warm_qwen2)
    batch = load_train_batch(c.run_dir / "iterations/000000/batch.pt")
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert all(ids[0] == start for ids in batch.prompt_ids)
    assert tokenizer.decode(batch.prompt_ids[0][-3:]) == "<|im_start|>assistant\n"
    assert any(ids[-1] == end for ids in batch.response_ids)
    # The checkpoint keeps the model's bf16; the training state keeps fp32 masters.
    checkpoint = next((c.run_dir / "checkpoints").glob("iter-000000*"))
    assert {t.dtype for t in load_file(checkpoint / "model.safetensors").values()} == {
        torch.bfloat16}
    state = c.run_dir / "train_state/iter-000000"
    (index,) = train_state.complete_state(state)
    assert {t.dtype for t in train_state.load_shard(state, index).weights.values()} == {
        torch.float32}
    slept = json.loads((c.run_dir / f"iterations/000000/phase-07/arrive-{FAULTY}.json")
                       .read_text())["payload"]
    served = phase12(c, FAULTY)["payload"]
    assert served["engine"] == "restarted after a failed reload"
    assert served["engine_pid"] != slept["engine_pid"]  # a new process
    assert served["probe_mean_abs_diff"] <= served["probe_tolerance"]
    assert "reloading iter-000000" in c.output(FAULTY)
    assert "failed, restarting the engine instead" in c.output(FAULTY)
    assert phase12(c, 0)["payload"]["engine"] == "reloaded"


def test_a_restart_that_fails_after_a_failed_reload_stops_the_run_with_the_log_tail(
        tmp_path: Path, warm_model: Path) -> None:
    c, codes = run_with_fault(tmp_path, warm_model,
                              {"reload": "unreadable", "fail_start_from": 2})
    assert codes == {0: 4, 1: 4}, {r: c.output(r)[-2000:] for r in codes}
    text = c.output(0)
    assert re.search(rf"rank {FAULTY} on host \S+: the hf inference engine could not serve "
                     r"\S+iter-000000-\w+", text), text[-3000:]
    assert "an injected fault" in phase12(c, FAULTY)["error"]  # the log tail
