"""One node making a delta checkpoint whole in its node-local cache, against the same
work done the way it was before (issue 34: the node's share of the delta update).

    python benchmarks/delta_apply_bench.py                 # 955 MiB asked: 948 MiB of bf16 in 114 tensors, 3 trials
    python benchmarks/delta_apply_bench.py --mib 180 --trials 5

A checkpoint of bf16 tensors (896 x 4864 each, Qwen2.5-0.5B's MLP shape) is published
full, then 1.5 % of its elements are changed (as one AdamW step at lr 1e-6 does, BENCHMARKS
section 11) and it is published again as a delta (publish_checkpoint, on this node's disk:
no network here, so only the node's own work is measured).  Each trial, on a fresh cache
holding the parent's copy (its pages in the page cache, as on a node that made it):

  peer  the apply as it was before the kernel-side clone (rebuilt here): the parent's
        file read into memory, the delta put back (trainer/delta.py apply), every
        tensor's SHA-256 checked (the manifest's checksum then: computed here from
        the trainer's file before the trials), a new file written and fsynced;
  ours  copy_to_local_cache: the parent's file cloned by the kernel (copy_file_range),
        the changed elements written into the clone through a shared map, every
        tensor's BLAKE3 checked (the manifest's `tensor_hash`), the copy sealed for this boot (not fsynced:
        coordinator/storage/local_seal.py; fsynced where the kernel names no boot);
  in place  copy_to_local_cache with advance, as the engine's cache (it keeps one
        model, rl/engine_host.py): the parent's copy itself taken and the changed
        elements written into it, no clone; otherwise as ours.

All check every tensor they make against the manifest.  The last lines read
    in place: Y2 s, ours/in place R
    delta apply: peer X s, ours Y s, peer/ours Z
(medians over the trials).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer import delta  # noqa: E402
from trainer.checkpoint import publish_checkpoint  # noqa: E402
from trainer.local_copy import copy_to_local_cache  # noqa: E402
from trainer.manifest import delta_file, read_manifest  # noqa: E402

SHAPE = (896, 4864)
CHANGED = 0.015


class Weights:
    """The save_pretrained interface publish_checkpoint uses, for plain bf16 tensors."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def save_pretrained(self, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file

        (Path(directory) / "config.json").write_text('{"model_type": "qwen2"}\n')
        save_file(self.tensors, str(Path(directory) / "model.safetensors"),
                  metadata={"format": "pt"})


def tensors(mib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parent's tensors and the child's (CHANGED of every tensor's elements moved)."""
    import torch

    g = torch.Generator().manual_seed(0)
    count = max(1, (mib << 20) // (SHAPE[0] * SHAPE[1] * 2))
    parent = {f"layers.{i}.weight": torch.randn(*SHAPE, generator=g).to(torch.bfloat16)
              for i in range(count)}
    child = {}
    for name, t in parent.items():
        flat = t.flatten().clone()
        pick = torch.rand(flat.numel(), generator=g) < CHANGED
        flat[pick] = (flat[pick].float() * (1 + 1e-2)).to(torch.bfloat16)
        child[name] = flat.reshape(t.shape)
    return parent, child


def sha256_digests(path: Path) -> dict[str, str]:
    """Every tensor's SHA-256 in the safetensors file `path` (what a manifest held)."""
    data = path.read_bytes()
    return delta.tensor_digests(data, delta.header(data, path)[1], "sha256")


def peer(share: Path, parent_copy: Path, out: Path, digests: dict[str, str]) -> None:
    """The apply before the clone: read the parent's file, put the delta back, check
    every tensor's SHA-256 (`digests`), write a new file and fsync it."""
    manifest = read_manifest(share / "iter-000001")
    assert manifest.delta is not None
    out.mkdir()
    for result in manifest.delta.results:
        data = (share / "iter-000001" / delta_file(result)).read_bytes()
        with open(parent_copy / result, "rb") as source:
            buffer = bytearray(os.fstat(source.fileno()).st_size)
            source.readinto(buffer)
        delta.apply(buffer, data, result=result, where=share, digests=digests,
                    algorithm="sha256")
        with open(out / result, "wb") as handle:
            handle.write(buffer)
            handle.flush()
            os.fsync(handle.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=955, help="the checkpoint's size")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="delta-apply-"))
    try:
        share, last = root / "share", root / "last"
        parent, child = tensors(args.mib)
        publish_checkpoint(Weights(parent), None, share / "iter-000000", iteration=0,
                           last_published=last)
        published = publish_checkpoint(Weights(child), None, share / "iter-000001",
                                       iteration=1, last_published=last,
                                       delta_parent=share / "iter-000000")
        assert published.delta is not None, "the child was published full"
        digests = sha256_digests(last / "model.safetensors")  # the child's, as trained
        size = sum(e.size for e in published.delta.results.values())
        moved = sum(e.size for n, e in published.files.items() if n.startswith("delta/"))
        print(f"checkpoint {size / 2**20:.0f} MiB, delta {moved / 2**20:.1f} MiB "
              f"({moved / size:.3f})", flush=True)
        times: dict[str, list[float]] = {"peer": [], "ours": [], "in place": []}
        for trial in range(args.trials):
            for mode in times:
                cache = root / f"cache-{mode}-{trial}"
                parent_copy = copy_to_local_cache(share / "iter-000000", cache)
                os.sync()
                started = time.perf_counter()
                if mode == "peer":
                    peer(share, parent_copy, cache / "peer-result", digests)
                    made = cache / "peer-result" / "model.safetensors"
                else:
                    made = copy_to_local_cache(share / "iter-000001", cache,
                                               advance=mode == "in place") / "model.safetensors"
                    if (mode == "in place") == parent_copy.exists():
                        raise RuntimeError(f"{mode}: the parent's copy was "
                                           f"{'kept' if parent_copy.exists() else 'taken'}")
                times[mode].append(time.perf_counter() - started)
                if made.stat().st_size != size:
                    raise RuntimeError(f"{mode} made {made.stat().st_size} bytes, not {size}")
                shutil.rmtree(cache)
            print(f"trial {trial + 1}: peer {times['peer'][-1]:.2f} s, "
                  f"ours {times['ours'][-1]:.2f} s, in place {times['in place'][-1]:.2f} s",
                  flush=True)
        p, o = statistics.median(times["peer"]), statistics.median(times["ours"])
        i = statistics.median(times["in place"])
        print(f"in place: {i:.2f} s, ours/in place {o / i:.2f}")
        print(f"delta apply: peer {p:.2f} s, ours {o:.2f} s, peer/ours {p / o:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
