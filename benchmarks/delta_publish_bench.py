"""The publisher's work for one delta checkpoint, against the same work done the ways it
was before (issue 34: the publisher's share of the delta update).

    python benchmarks/delta_publish_bench.py                 # 955 MiB asked: 948 MiB of bf16 in 114 tensors, 3 trials
    python benchmarks/delta_publish_bench.py --mib 180 --trials 5

float32 tensors (896 x 4864 each, Qwen2.5-0.5B's MLP shape), as the trainer holds them,
are published in bf16; then 1.5 % of their elements move by 1 % (as one AdamW step at lr
1e-6 changes 1.2-1.9 % of the bf16 elements: BENCHMARKS section 11).  Each trial, for
each way, the last publication's file is kept on this node's disk (a fresh copy, its
pages in the page cache, as right after that publication; `sync` before the clock
starts), and the clock runs from the trainer's float32 tensors to the delta's tensors
and the checksums its manifest lists:

  peer      the delta before the kept files advanced (rebuilt here): the checkpoint
            written whole in bf16 into the staging directory, then compared with the
            kept file (`delta.encode` as it was: the new file's SHA-256, one stream,
            beside the comparison, then every tensor's BLAKE3);
  previous  `kept_delta.advance` before the results' whole-file hash went (rebuilt
            here): each tensor cast, compared with the kept file and written into it
            through its shared map, its BLAKE3 taken, a thread per core, the file's
            SHA-256 following tensor by tensor;
  ours      `kept_delta.advance`: the same, with a tensor whose pages all change
            written with pwrite (not through the map) and no whole-file hash (the
            manifest lists the header's SHA-256 and every tensor's BLAKE3:
            trainer/manifest.py `ResultEntry`).

The three are checked to make the same delta and the same checksum of every tensor.
The last lines read
    previous: Y2 s, previous/ours R
    delta publish: peer X s, ours Y s, peer/ours Z
(medians over the trials).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.delta_apply_bench import CHANGED, SHAPE  # noqa: E402  (the same workload)
from trainer import delta, kept_delta  # noqa: E402

Made = tuple[dict[str, Any], dict[str, str], int]  # the delta's tensors, digests, changed


def tensors(mib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainer's float32 tensors at the last publication and one step later."""
    import torch

    g = torch.Generator().manual_seed(0)
    count = max(1, (mib << 20) // (SHAPE[0] * SHAPE[1] * 2))
    before = {f"layers.{i}.weight": torch.randn(*SHAPE, generator=g) * 0.02
              for i in range(count)}
    after = {}
    for name, t in before.items():
        flat = t.flatten().clone()
        pick = torch.rand(flat.numel(), generator=g) < CHANGED
        flat[pick] *= 1 + 1e-2
        after[name] = flat.reshape(t.shape)
    return before, after


def peer(state: Mapping[str, Any], kept: Path, staging: Path) -> Made:
    """The checkpoint written whole, then encoded against `kept` as it was."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    new = staging / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in state.items()}, str(new),
              metadata={"format": "pt"})
    with open(new, "rb") as nf, open(kept, "rb") as of, \
            mmap.mmap(nf.fileno(), 0, access=mmap.ACCESS_READ) as nm, \
            mmap.mmap(of.fileno(), 0, access=mmap.ACCESS_READ) as om:
        _, spans = delta.header(nm, new)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(lambda: hashlib.sha256(nm).hexdigest())
            parts: dict[str, Any] = {}
            changed = 0
            for span in spans.values():
                found, count = delta.changes(
                    np.frombuffer(nm, dtype=span.int_dtype, count=span.count,
                                  offset=span.begin),
                    np.frombuffer(om, dtype=span.int_dtype, count=span.count,
                                  offset=span.begin), span)
                parts.update(found)
                changed += count
            digests = delta.tensor_digests(nm, spans)
            whole.result()
    return parts, digests, changed


def previous(state: Mapping[str, Any], kept: Path) -> Made:
    """`kept` advanced to `state` as kept_delta.advance did before this change."""
    with open(kept, "r+b") as handle:
        data = mmap.mmap(handle.fileno(), 0)
        try:
            _, spans = delta.header(data, kept)
            order = sorted(spans.values(), key=lambda span: span.begin)
            done = {span.name: threading.Event() for span in order}
            with concurrent.futures.ThreadPoolExecutor(1) as streamer:
                whole = streamer.submit(_sha256_following, data, order, done)
                with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                    futures = {span.name: pool.submit(_patch_through_map, data, span,
                                                      state[span.name], done[span.name])
                               for span in order}
                found = {name: future.result() for name, future in sorted(futures.items())}
                whole.result()
        finally:
            data.close()
    parts: dict[str, Any] = {}
    for tensor_parts, _, _ in found.values():
        parts.update(tensor_parts)
    return (parts, {name: digest for name, (_, _, digest) in found.items()},
            sum(count for _, count, _ in found.values()))


def _patch_through_map(data: mmap.mmap, span: delta.Span, tensor: Any,
                       done: threading.Event) -> tuple[dict[str, Any], int, str]:
    import numpy as np
    import torch

    try:
        now = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().reshape(-1)
        was = np.frombuffer(data, dtype=span.int_dtype, count=span.count, offset=span.begin)
        parts, count = delta.changes(now, was, span)
        if count:
            np.copyto(was, now)
        del was
        return parts, count, delta.digest(data, span)
    finally:
        done.set()


def _sha256_following(data: mmap.mmap, order: Sequence[delta.Span],
                      done: Mapping[str, threading.Event]) -> str:
    sha = hashlib.sha256()
    with memoryview(data) as view:
        sha.update(view[:order[0].begin])
        for span in order:
            done[span.name].wait()
            sha.update(view[span.begin:span.end])
    return sha.hexdigest()


def ours(state: Mapping[str, Any], kept: Path) -> Made:
    made = kept_delta.advance(kept, state, "bfloat16", fsync=False)
    return made.tensors, made.digests, made.changed


def same(a: Made, b: Made, what: str) -> None:
    """RuntimeError unless `a` and `b` are the same delta with the same checksums."""
    if a[1] != b[1] or a[2] != b[2] or a[0].keys() != b[0].keys() or not all(
            bool((a[0][k] == b[0][k]).all()) for k in a[0]):
        raise RuntimeError(f"{what} made another delta or other checksums")


def main() -> None:
    import torch
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=955, help="the checkpoint's size in bf16")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="delta-publish-"))
    try:
        before, after = tensors(args.mib)
        base = root / "base.safetensors"  # the last publication's file
        save_file({n: t.to(torch.bfloat16) for n, t in before.items()}, str(base),
                  metadata={"format": "pt"})
        print(f"checkpoint {base.stat().st_size / 2**20:.0f} MiB in {len(before)} tensors",
              flush=True)
        times: dict[str, list[float]] = {"peer": [], "previous": [], "ours": []}
        made: dict[str, Made] = {}
        for trial in range(args.trials):
            for mode in times:
                work = root / f"{mode}-{trial}"
                work.mkdir()
                kept = work / "kept.safetensors"
                shutil.copyfile(base, kept)
                os.sync()
                started = time.perf_counter()
                if mode == "peer":
                    (work / "staging").mkdir()
                    made[mode] = peer(after, kept, work / "staging")
                elif mode == "previous":
                    made[mode] = previous(after, kept)
                else:
                    made[mode] = ours(after, kept)
                times[mode].append(time.perf_counter() - started)
                shutil.rmtree(work)
            same(made["peer"], made["ours"], "ours")
            same(made["peer"], made["previous"], "previous")
            elements = sum(t.numel() for t in after.values())
            print(f"trial {trial + 1}: peer {times['peer'][-1]:.2f} s, previous "
                  f"{times['previous'][-1]:.2f} s, ours {times['ours'][-1]:.2f} s "
                  f"({made['ours'][2] / elements:.4f} of the elements changed)", flush=True)
        p, v, o = (statistics.median(times[m]) for m in ("peer", "previous", "ours"))
        print(f"previous: {v:.2f} s, previous/ours {v / o:.2f}")
        print(f"delta publish: peer {p:.2f} s, ours {o:.2f} s, peer/ours {p / o:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
