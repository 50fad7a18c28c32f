"""The real loop on 2 daemons with `train.strategy = "fsdp2"` (gloo here), on a
Qwen2-shaped model whose lm_head is its embedding matrix (Qwen2.5-0.5B's way):
rank 0 of the trainer gathers the weights to publish them (trainer/sharded_save.py),
so iteration 1's checkpoint is a delta of iteration 0's; the tied matrix is trained
and published as one, and phase 12's probes find the engines serving exactly the
published weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.integration.test_rl_loop import CONFIG, LEASE
from tests.support.cluster import LocalCluster
from trainer.checkpoint import verify_checkpoint

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 600  # two iterations on 2 daemons and 2 trainer ranks: ~1-2 min idle


@pytest.fixture(scope="module")
def warm_tied_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.architectures import WARMSTART_STEPS_BY_SIZE, Size, preset
    from trainer.warmstart import build_initial_model

    out = tmp_path_factory.mktemp("model") / "qwen2-tied"
    build_initial_model(out, seed=0, warmstart_steps=WARMSTART_STEPS_BY_SIZE[Size.TINY],
                        spec=preset("qwen2", "tiny", tie_word_embeddings=True))
    return out


def names(checkpoint: Path) -> set[str]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_fsdp2_in_the_loop_publishes_deltas_and_keeps_a_tied_matrix_one(
        tmp_path: Path, warm_tied_qwen2: Path) -> None:
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(model=warm_tied_qwen2, iterations=2, lease=LEASE,
                                    on_failure="exit")
                      .replace("[train]\n", '[train]\nstrategy = "fsdp2"\n')
                      # two samples of a chat prompt: greedy takes one (rl/setting_rules.py)
                      .replace("[rollout]\n", "[rollout]\neval_temperature = 1.0\n"))
    c = LocalCluster(tmp_path / "run", tmp_path, num_nodes=2, config=config)
    try:
        c.start_all()
        codes = c.wait_all(timeout=RUN_TIMEOUT_S)
    finally:
        c.close()
    assert codes == {0: 0, 1: 0}, {r: c.output(r)[-3000:] for r in codes}
    run = c.run_dir
    for it in (0, 1):
        metrics = json.loads((run / f"iterations/{it:06d}/metrics/train.json").read_text())
        assert metrics["strategy"] == "fsdp2" and metrics["world_size"] == 2, metrics
    full, delta = (verify_checkpoint(run / f"checkpoints/iter-{it:06d}") for it in (0, 1))
    assert full.delta is None and delta.delta is not None
    assert delta.delta.parent == "iter-000000" and "delta/model.safetensors" in delta.files
    # The tied matrix once, as in the model the run started from.
    assert names(run / "checkpoints/iter-000000") == names(warm_tied_qwen2)
    assert "lm_head.weight" not in names(warm_tied_qwen2)
    logs = "".join(p.read_text(errors="replace") for p in (run / "ranks/0/logs").glob("*.log"))
    assert logs.count("publishing by gather") == 2, logs[-3000:]
