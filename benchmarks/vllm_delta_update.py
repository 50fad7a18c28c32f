"""A delta update into a running vLLM engine, timed: the trainer's step published as a
delta, made whole in the node's cache, and reloaded in place (issue 34, done when 4).

    python benchmarks/vllm_delta_update.py --vllm $(which vllm)          # on a GPU node
    python benchmarks/vllm_delta_update.py --vllm .venv-vllm/bin/vllm --device cpu --small
    python benchmarks/vllm_delta_update.py --engine hf                   # no vLLM there

`--engine hf` runs the same update into the built-in hf engine (rollout/hf), which
answers the same control requests: the path up to the engine, on a GPU node without
vLLM, and the hf engine's own reload on that GPU.

benchmarks/gpu_check.py runs it after its training check where a `vllm` executable is
found.  Qwen2.5-0.5B's shape is built here (trainer/architectures.py; `--small`: 2
layers and a 4,096-token vocabulary, for vLLM's CPU build), loaded in float32 and
published in bf16 as the run's first, full checkpoint; a vLLM server (the project's
engine, rollout/engines) starts on the node's copy of it.  Then one AdamW step at an RL
learning rate (1e-6), and, timed:

  publish  publish_checkpoint as a delta of the first (trainer/kept_delta.py)
  copy     copy_to_local_cache with advance, as the engine's cache makes it (the
           parent's copy advanced in place, every tensor checked)
  reload   the engine's update_weights: /pause, collective_rpc reload_weights from
           the copy, /reset_prefix_cache, /resume (rollout/engines/control.py); the hf
           engine: sleep, wake_up with the new weights (rollout/engines/weight_updates.py)

then the served weights are checked against the checkpoint's probes
(rl/served_weights.py), as phase 12 does.  A step at lr 1e-6 moves the probes less
than their tolerance, so that check cannot tell the new weights from the old: one
more delta, after a step at lr 1e-3, goes the same way, and the engine must serve it
with its probes moved past the tolerance (what it served before would fail).  The
last line reads
    vllm delta update: delta F of the model, publish P s, copy C s, reload R s, total T s
(`hf delta update: ...` with --engine hf)
and the exit status is 0 when the engine serves the new weights.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LR = 1e-6
# vLLM's CPU build: float32 (its bf16 kernels need AMX, which some VMs advertise and
# then refuse), eager, a KV cache of its own size.  On a GPU: eager (the update is
# timed, not the serving), half the memory (the trainer's model is on the same GPU).
ENGINE_ARGS = {"cpu": ("--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)),
               "cuda": ("--enforce-eager", "--gpu-memory-utilization", "0.5")}


def probes_of(model: Any, device: str) -> Any:
    """The model's probes (trainer/probes.py), scored as its bf16 publication is served."""
    from trainer.probes import make_probe_set
    from trainer.train import _special_ids

    model.eval()
    try:
        return make_probe_set(
            lambda ids: model(input_ids=ids.to(device), use_cache=False).logits.float().cpu(),
            vocab_size=int(model.config.vocab_size), special_ids=_special_ids(model.config),
            dtype="bfloat16")
    finally:
        model.train()


def step(model: Any, optimizer: Any, device: str) -> None:
    """One AdamW step on 2 x 64 random tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(model.config.vocab_size), (2, 64), generator=g).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def run(vllm: Path | None, device: str, work: Path, *, small: bool) -> dict[str, Any]:
    """The update, timed (module docstring), into vLLM, or into the hf engine where
    `vllm` is None; RuntimeError when the engine does not serve the new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.engines.engine import EngineConfig, EngineKind, make_engine
    from trainer.architectures import create_model, preset
    from trainer.checkpoint import publish_checkpoint
    from trainer.local_copy import copy_to_local_cache

    overrides = dict(num_hidden_layers=2, vocab_size=4096) if small else {}
    model_dir, share, cache = work / "model", work / "share", work / "cache"
    create_model(model_dir, preset("qwen2", "0.5b", **overrides))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def publish(iteration: int) -> Any:
        return publish_checkpoint(
            model, None, share / f"iter-{iteration:06d}", iteration=iteration,
            carry_files_from=model_dir, dtype="bfloat16", probes=probes_of(model, device),
            last_published=work / "last-published",
            delta_parent=share / f"iter-{iteration - 1:06d}" if iteration else None)

    publish(0)
    engine_args: dict[str, Any] = (
        dict(kind=EngineKind.HF, device=device) if vllm is None else
        dict(kind=EngineKind.VLLM, vllm_executable=str(vllm), extra_args=ENGINE_ARGS[device]))
    config = EngineConfig(**engine_args, dtype="float32" if device == "cpu" else "bfloat16",
                          max_model_len=256, ready_timeout_s=900, request_timeout_s=300)
    engine = make_engine(config, log_dir=work / "logs")
    try:
        engine.start(copy_to_local_cache(share / "iter-000000", cache, advance=True))
        step(model, optimizer, device)
        started = time.perf_counter()
        manifest = publish(1)
        published = time.perf_counter()
        copy = copy_to_local_cache(share / "iter-000001", cache, advance=True)
        copied = time.perf_counter()
        engine.update_weights(copy)
        reloaded = time.perf_counter()
        if manifest.delta is None:
            raise RuntimeError("iteration 1 was published full, not as a delta")
        served(engine, copy, previous=None)
        # A step the probes tell apart, through the same path.
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        step(model, optimizer, device)
        if publish(2).delta is None:
            raise RuntimeError("iteration 2 was published full, not as a delta")
        copy = copy_to_local_cache(share / "iter-000002", cache, advance=True)
        engine.update_weights(copy)
        verdict = served(engine, copy, previous=manifest.probes)
        if verdict.moved is None or verdict.tolerance is None \
                or verdict.moved <= verdict.tolerance:
            raise RuntimeError(f"the step at lr 1e-3 moved the probes by {verdict.moved}, "
                               f"within their tolerance {verdict.tolerance}: the check "
                               "cannot tell the weights apart")
    finally:
        engine.close()
    size = sum(e.size for e in manifest.delta.results.values())
    moved = sum(e.size for n, e in manifest.files.items() if n.startswith("delta/"))
    return {"engine": config.kind.value, "model_bytes": size, "delta_bytes": moved,
            "publish_s": published - started, "copy_s": copied - published, "reload_s": reloaded - copied,
            "total_s": reloaded - started, "mean_abs_diff": verdict.mean_abs_diff,
            "tolerance": verdict.tolerance, "moved": verdict.moved}


def served(engine: Any, copy: Path, *, previous: Any) -> Any:
    """rl/served_weights.py's verdict on the engine serving `copy`; RuntimeError naming
    what it found otherwise."""
    from rl.served_weights import WeightsNotServed, verify_served_weights
    from rollout.engines.config import EngineError

    try:
        verdict = verify_served_weights(engine.control(), engine.config, copy, rank=0,
                                        host="here", previous=previous)
    except (WeightsNotServed, EngineError) as exc:  # other weights, or a failed engine
        raise RuntimeError(f"the engine does not serve {copy.name}: {exc}") from exc
    if not verdict.probed:
        raise RuntimeError(f"{copy.name} has no probes: nothing was checked")
    return verdict


def report(result: dict[str, Any]) -> None:
    print(f"served weights after a step at lr 1e-3, published as a delta: mean |log-"
          f"probability difference| {result['mean_abs_diff']:.2e} against its probes "
          f"(tolerance {result['tolerance']:g}; they moved {result['moved']:.2e} from the "
          "weights before)")
    share = result["delta_bytes"] / result["model_bytes"]
    print(f"{result['engine']} delta update: delta {share:.3f} of the model "
          f"({result['model_bytes'] / 2**20:.0f} MiB), publish {result['publish_s']:.2f} s, copy {result['copy_s']:.2f} s, reload "
          f"{result['reload_s']:.2f} s, total {result['total_s']:.2f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=shutil.which("vllm") or "",
                        help="the vllm executable (default: the one on PATH)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm",
                        help="hf: the built-in engine, where no vLLM is installed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true",
                        help="2 layers, a 4,096-token vocabulary (vLLM's CPU build)")
    args = parser.parse_args()
    hf = args.engine == "hf"
    if not hf and (not args.vllm or not Path(args.vllm).exists()):
        print(f"vllm delta update: no vllm executable ({args.vllm or 'none on PATH'}): pass "
              "--vllm PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vllm-delta-") as tmp:
        try:
            result = run(None if hf else Path(args.vllm), args.device, Path(tmp),
                         small=args.small)
        except RuntimeError as exc:
            print(f"{args.engine} delta update: {exc}", file=sys.stderr)
            return 1
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
