"""Phase 1's check that the engine serves the policy phase 0 chose (issue 32, finding 5),
against a real hf engine process on two published checkpoints with their probes.

    ensure(iter-1)              phase 12: the engine serves version 2
    serve_chosen(iter-0)        phase 0 chose version 1, older: refused, naming both;
                                the engine keeps serving version 2 (no silent downgrade)
    serve_chosen(iter-1)        kept, and its probes checked all the same
    (iter-0 loaded behind the host's back, as a stray client could)
    serve_chosen(iter-1)        kept by name, but the probes say otherwise: the phase fails
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.config.run_config import RunConfig
from coordinator.errors import ActionError
from coordinator.machine.actions import StepContext
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from rl import layout, node_local
from rl.config import parse_sections
from rl.engine_host import EngineHost
from rl.served_weights import WeightsNotServed
from trainer.checkpoint import MANIFEST_NAME, seal_directory
from trainer.probes import make_probe_set
from trainer.tiny_model import create_tiny_model

pytestmark = pytest.mark.slow


def publish(run: Path, scratch: Path, k: int, seed: int) -> Path:
    """checkpoints/iter-<k>: a tiny model with the probes the trainer would record."""
    from transformers import AutoModelForCausalLM

    source = create_tiny_model(scratch / f"model-{k}", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        probes = make_probe_set(lambda ids: model(input_ids=ids).logits,
                                vocab_size=model.config.vocab_size, special_ids=[],
                                dtype="float32")
    tmp = scratch / f"staging-{k}"
    shutil.copytree(source, tmp)
    (tmp / MANIFEST_NAME).unlink(missing_ok=True)
    final = layout.checkpoint(run, k)
    final.parent.mkdir(parents=True, exist_ok=True)
    seal_directory(tmp, final, iteration=k, probes=probes)
    return final


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[EngineHost, StepContext]]:
    run = tmp_path / "run"
    run.mkdir()
    sections = parse_sections({"checkpoint": {"local_cache": str(tmp_path / "cache")},
                               "engine": {"ready_timeout_s": 300.0}})
    engine_host = EngineHost(sections, rank=0, run_dir=run)
    ctx = StepContext(rank=0, num_nodes=1, iteration=2, phase=Phase.ROLLOUT, run_dir=run,
                      run_id="0123456789ab", config=RunConfig.from_dict({}), weights=(1.0,),
                      host="node-a", address="127.0.0.1", runtime=Runtime())
    try:
        yield engine_host, ctx
    finally:
        engine_host.close()
        node_local.leave_all(keep=False)


def test_phase_1_refuses_an_older_policy_and_checks_a_kept_engines_probes(
    host: tuple[EngineHost, StepContext], tmp_path: Path,
) -> None:
    engine_host, ctx = host
    older = publish(ctx.run_dir, tmp_path, 0, seed=1)
    newest = publish(ctx.run_dir, tmp_path, 1, seed=2)

    served = engine_host.ensure(ctx, newest, version=2)  # phase 12 of iteration 1
    assert served["engine"] == "started"
    pid = served["engine_pid"]

    with pytest.raises(ActionError, match=r"rank 0 on host node-a: phase 0 chose policy version "
                                          r"1 \(iter-000000\), but this node's engine serves "
                                          r"version 2 \(iter-000001-\w+\), a newer one"):
        engine_host.serve_chosen(ctx, older, version=1)

    kept = engine_host.serve_chosen(ctx, newest, version=2)
    assert kept["engine"] == "kept" and kept["engine_pid"] == pid
    assert kept["probe_mean_abs_diff"] < kept["probe_tolerance"]  # checked, not assumed

    # The engine is made to serve the older weights behind the host's back.
    engine = engine_host._engine
    assert engine is not None
    with engine_host.local_copy(ctx, older) as copy:
        engine.update_weights(copy)
    with pytest.raises(WeightsNotServed, match=r"does not serve checkpoint iter-000001"):
        engine_host.serve_chosen(ctx, newest, version=2)
    # Not taken as served any more: the rerun loads it again, and then it passes.
    again = engine_host.serve_chosen(ctx, newest, version=2)
    assert again["engine"] != "kept" and again["probe_mean_abs_diff"] < again["probe_tolerance"]
