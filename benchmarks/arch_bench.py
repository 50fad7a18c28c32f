"""A model of a real architecture built here, then served once by vLLM.

    python benchmarks/arch_bench.py --out models/qwen2-0.5b           # Qwen2.5-0.5B's shape
    python benchmarks/arch_bench.py --out m --arch llama --size small --vllm /path/to/vllm

1. Build: `coordinator init-model --arch ARCH --size SIZE --out OUT` in a process of
   its own (no warm start for 0.5b); its wall time, the directory's size on disk and
   the parameter count.  An --out that exists already is served as it is.
2. Serve, for each of --engines (vllm, and the hf engine as the peer): the
   project's engine code (rollout/engines/) on it, with the settings this
   machine's CPU build of vLLM needs (float32: its bf16 kernels want AMX; eager;
   a KV cache of its own size), until one chat completion answers: the start time.
3. Generate: --requests chat requests of the built-in task's prompts, --n samples
   of up to --max-tokens new tokens each (no stop but the model's end of turn, which
   a random model rarely samples), 8 in flight; generated tokens per second.

Prints one JSON object with every figure (docs/BENCHMARKS.md records them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from rollout.client import CompletionClient  # noqa: E402
from rollout.engines.engine import EngineConfig, EngineKind, make_engine  # noqa: E402
from rollout.tasks import BuiltinReverseTasks  # noqa: E402
from trainer.architectures import preset  # noqa: E402

MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30


def build(out: Path, arch: str, size: str) -> dict[str, object]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator_cli", "init-model", "--out", str(out), "--arch", arch,
         "--size", size], cwd=ROOT, capture_output=True, text=True, timeout=3600,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"init-model failed ({done.returncode}): {done.stderr[-2000:]}")
    return {"build_s": round(seconds, 1), "build_output": done.stdout.strip()}


def serve(model: Path, kind: str, vllm: str, requests: int, n: int,
          max_tokens: int) -> dict[str, object]:
    common: dict[str, Any] = dict(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                     ready_timeout_s=1200, request_timeout_s=1200,
                                     stop_grace_s=15)
    config = EngineConfig(kind=EngineKind.HF, max_batch=32, **common) if kind == "hf" \
        else EngineConfig(kind=EngineKind.VLLM, vllm_executable=vllm, extra_args=(
            "--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)), **common)
    with tempfile.TemporaryDirectory() as logs:
        engine = make_engine(config, log_dir=Path(logs))
        try:
            started = time.perf_counter()
            engine.start(model)
            client = CompletionClient(engine.base_url, engine.api_key, model="policy",
                                      retries=0, concurrency=8, request_timeout_s=1200)
            client.complete_one([{"role": "user", "content": "12>"}], n=1, max_tokens=1)
            start_s = time.perf_counter() - started
            tasks = BuiltinReverseTasks(seed=0, chat=True).tasks("train")[:requests]
            t0 = time.perf_counter()
            groups = client.generate_groups([t.messages() or str(t.prompt) for t in tasks], n=n,
                                            max_tokens=max_tokens, temperature=1.0,
                                            seeds=list(range(len(tasks))))
            seconds = time.perf_counter() - t0
        finally:
            engine.close()
    failed = [g.error for g in groups if not g.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, first: {failed[0]}")
    tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
    return {"start_s": round(start_s, 1), "generated_tokens": tokens,
            "generate_s": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--vllm", default=str(ROOT / ".venv-vllm" / "bin" / "vllm"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engines", default="vllm,hf")
    args = parser.parse_args()
    result: dict[str, object] = {"arch": args.arch, "size": args.size,
                                 "parameters": preset(args.arch, args.size).parameters()}
    if not args.out.exists():
        result.update(build(args.out, args.arch, args.size))
    result["disk_bytes"] = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    for kind in args.engines.split(","):
        result[kind] = serve(args.out, kind, args.vllm, args.requests, args.n, args.max_tokens)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
