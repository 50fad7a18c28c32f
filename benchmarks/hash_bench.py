"""SHA-256 against BLAKE3 for the per-tensor checksums of a delta checkpoint's result
(issue 34: every node hashes the whole result at every delta).

    python benchmarks/hash_bench.py              # 1 GiB of bf16 tensors, 3 trials
    python benchmarks/hash_bench.py --mib 256

Both hash the same tensors of one safetensors file held in memory, the way a node
checks a result (trainer/delta.py tensor_digests): one tensor per thread, a thread
per core.  The peer is SHA-256 (hashlib, with the CPU's SHA extensions where it has
them), ours BLAKE3 (the blake3 package).  Also one stream on one core each, the
throughput with nothing else in the way.  The last line reads
    tensor hash: sha256 X GiB/s, blake3 Y GiB/s, blake3/sha256 Z
(medians over the trials, the per-tensor threads).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import blake3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import delta  # noqa: E402

SHAPE = (896, 4864)  # Qwen2.5-0.5B's MLP projection, bf16


def weights_file(mib: int) -> bytes:
    """A safetensors file of bf16 tensors, `mib` MiB, as transformers writes one."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    count = max(1, (mib << 20) // (SHAPE[0] * SHAPE[1] * 2))
    return save({f"layers.{i}.weight": torch.randn(*SHAPE, generator=g).to(torch.bfloat16)
                 for i in range(count)}, metadata={"format": "pt"})


def timed(call: Callable[[], object], trials: int) -> float:
    times = []
    for _ in range(trials):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    data = weights_file(args.mib)
    spans = delta.header(data, Path("<memory>"))[1]
    gib = len(data) / 2**30
    print(f"{gib:.2f} GiB in {len(spans)} tensors", flush=True)
    one = {"sha256": lambda: hashlib.sha256(data).hexdigest(),
           "blake3": lambda: blake3.blake3(data).hexdigest()}
    for name, call in one.items():
        print(f"one stream, {name}: {gib / timed(call, args.trials):.2f} GiB/s", flush=True)
    rates = {}
    for name in ("sha256", "blake3"):
        seconds = timed(lambda name=name: delta.tensor_digests(data, spans, name), args.trials)
        rates[name] = gib / seconds
        print(f"per tensor, a thread per core, {name}: {seconds:.3f} s, "
              f"{rates[name]:.2f} GiB/s", flush=True)
    print(f"tensor hash: sha256 {rates['sha256']:.2f} GiB/s, blake3 {rates['blake3']:.2f} "
          f"GiB/s, blake3/sha256 {rates['blake3'] / rates['sha256']:.2f}")


if __name__ == "__main__":
    main()
