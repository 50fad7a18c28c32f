"""The hf engine against vLLM's CPU build, on the demo's model, in one run.

    python benchmarks/vllm_bench.py                       # .venv-vllm/bin/vllm
    python benchmarks/vllm_bench.py --vllm /path/to/vllm --starts 2 --cycles 5

Both engines are driven by the project's own engine code (rollout/engines/engine.py)
with the settings the demo gives them (float32, 128 positions; vLLM eager with
a 256 MiB KV cache, the hf engine on one thread per process), one engine at a
time (every hf measurement, then every vLLM one):

1. Start: a cold start on the warm-started demo model until one completion
   answers (phase 1's first start), median of --starts.
2. Throughput: the rollout's own request pattern: --tasks prompts of the
   built-in task, a group of 8 samples each, up to 6 new tokens, with the demo's
   concurrency (4 requests in flight); generated tokens per second.
3. Reload: sleep (phase 7), then the other checkpoint loaded in place and one
   completion (phase 12 until rollout can use it), median of --cycles.

Prints each figure for both engines and the ratio vLLM / hf.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from rollout.client import CompletionClient  # noqa: E402
from rollout.engines.engine import EngineConfig, EngineKind, make_engine  # noqa: E402
from rollout.tasks import BuiltinReverseTasks  # noqa: E402
from trainer.config import WARMSTART_STEPS  # noqa: E402
from trainer.warmstart import build_initial_model  # noqa: E402

ENGINES = ("hf", "vllm")
GROUP, MAX_TOKENS, CONCURRENCY = 8, 6, 4  # the tiny model's rollout (rl/config.py)


def config(kind: str, vllm: str) -> EngineConfig:
    common: dict[str, Any] = dict(ready_timeout_s=600, request_timeout_s=120, dtype="float32",
                                  max_model_len=128, stop_grace_s=15)
    if kind == "hf":
        return EngineConfig(kind=EngineKind.HF, threads=1, **common)
    return EngineConfig(kind=EngineKind.VLLM, vllm_executable=vllm,
                        extra_args=("--enforce-eager", "--kv-cache-memory-bytes",
                                    str(256 << 20)), **common)


def client(engine: Any) -> CompletionClient:
    return CompletionClient(engine.base_url, engine.api_key, model="policy", retries=0,
                            concurrency=CONCURRENCY, request_timeout_s=120)


def throughput(engine: Any, prompts: list[str]) -> float:
    started = time.perf_counter()
    groups = client(engine).generate_groups(prompts, n=GROUP, max_tokens=MAX_TOKENS,
                                            temperature=1.0, seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - started
    failed = [g.error for g in groups if not g.ok]
    if failed:
        raise SystemExit(f"{len(failed)} groups failed, first: {failed[0]}")
    return sum(len(s.token_ids) for g in groups for s in g.samples) / seconds


def measure(kind: str, vllm: str, models: list[Path], prompts: list[str], work: Path,
            starts: int, cycles: int) -> dict[str, float]:
    engine = make_engine(config(kind, vllm), log_dir=work / f"logs-{kind}")
    start_s, reload_s = [], []
    try:
        for _ in range(starts):
            t0 = time.perf_counter()
            engine.start(models[0])
            client(engine).complete_one("12>", n=1, max_tokens=1)
            start_s.append(time.perf_counter() - t0)
            engine.stop()
        engine.start(models[0])
        tokens_per_s = statistics.median(throughput(engine, prompts) for _ in range(3))
        serving = 0
        for _ in range(cycles):
            engine.sleep()  # not timed: the reload from a sleeping engine is
            t0 = time.perf_counter()
            engine.load_weights(models[1 - serving])
            client(engine).complete_one("12>", n=1, max_tokens=1)
            reload_s.append(time.perf_counter() - t0)
            serving = 1 - serving
    finally:
        engine.close()
    return {"start_s": statistics.median(start_s), "tokens_per_s": tokens_per_s,
            "reload_s": statistics.median(reload_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default=str(HERE.parent / ".venv-vllm" / "bin" / "vllm"))
    ap.add_argument("--starts", type=int, default=2, help="cold starts per engine")
    ap.add_argument("--cycles", type=int, default=5, help="sleep + reload cycles per engine")
    ap.add_argument("--tasks", type=int, default=64, help="prompts per throughput round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        work = Path(tmp)
        models = [work / "a", work / "b"]
        for seed, path in enumerate(models):
            build_initial_model(path, seed=seed, warmstart_steps=WARMSTART_STEPS)
        tasks = BuiltinReverseTasks(seed=0).tasks("train")[: args.tasks]
        prompts = [str(t.prompt) for t in tasks]
        results = {}
        for kind in ENGINES:
            print(f"{kind}: {args.starts} cold starts, throughput, {args.cycles} reloads ...",
                  flush=True)
            results[kind] = measure(kind, args.vllm, models, prompts, work, args.starts,
                                    args.cycles)
    hf, vl = results["hf"], results["vllm"]
    print(f"\n{'median':34s}{'hf':>10s}{'vLLM-CPU':>10s}{'vLLM/hf':>9s}")
    for key, label, unit in [("start_s", "cold start to first completion", "s"),
                             ("tokens_per_s", f"tokens/s ({CONCURRENCY} groups of {GROUP} "
                              "in flight)", ""),
                             ("reload_s", "reload after a sleep, to first completion", "s")]:
        print(f"{label:34s}{hf[key]:9.2f}{unit or ' '}{vl[key]:9.2f}{unit or ' '}"
              f"{vl[key] / hf[key]:9.2f}")


if __name__ == "__main__":
    main()
