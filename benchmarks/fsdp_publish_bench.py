"""An FSDP2 trainer's checkpoint through the shared filesystem: every rank's shards
staged there and consolidated (the peer, the trainer's only way before), against the
tensors gathered onto rank 0 over the process group and published as one process
publishes them, a delta of the last checkpoint after the first (trainer/sharded_save.py).

    python benchmarks/fsdp_publish_bench.py              # Qwen2.5-0.5B's shape, ~1 GB of bf16
    python benchmarks/fsdp_publish_bench.py --quick      # 4 layers, 32,768-token vocabulary

The model is built here (trainer/architectures.py), loaded sharded on 2 gloo ranks
(torchrun, this machine's CPUs) in float32 and trained at an RL learning rate
(AdamW, lr 1e-6, one step per iteration on 2 x 64 random tokens per rank).  Each
iteration publishes the same weights both ways, in the checkpoint's dtype (bf16),
into the sshfs fixture's one mount (tests/support/netfs.py), the trainer node's
view of the share; rank 0 stages on its own disk.  Per publication: the seconds
from the first rank's start to rank 0's sealed checkpoint (gather or shards,
consolidation, manifest), and the bytes the file server wrote and read, measured
at the sshd as benchmarks/weight_sync_bench.py measures them.

The last line reads
    fsdp publish: bytes peer/ours full X, delta Y; time peer/ours full Z, delta W
full: the first iteration (both full); delta: the median over the later ones (the
peer's checkpoints stay full), bytes written plus read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LR = 1e-6
BATCH, SEQ = 2, 64
MB = 1e6
ROUTES = ("peer", "ours")


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: load, then per iteration a step and both publications."""
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from benchmarks.train_memory_bench import emit_row
    from benchmarks.weight_sync_bench import Meter, ServerIo
    from trainer.checkpoint import publish_checkpoint, saved_dtype
    from trainer.config import TrainConfig
    from trainer.distributed import init_distributed, unwrap
    from trainer.sharded_load import load_sharded_model
    from trainer.sharded_save import gather_published, stage_sharded_weights

    hf_logging.disable_progress_bar()
    ctx = init_distributed(TrainConfig.from_dict({"strategy": "fsdp2", "device": "cpu"}))
    model_dir, share = args.model, args.share
    dtype = saved_dtype(model_dir)
    model = load_sharded_model(model_dir, ctx, trainable=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(ctx.rank)
    vocab = int(unwrap(model).config.vocab_size)
    tempfile.tempdir = str(args.node_tmp)  # rank 0's disk: its staging and kept files
    server = ServerIo(args.sshd_pid, args.port) if ctx.rank == 0 else None
    rows = []
    for it in range(args.iterations):
        if it:
            ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        row: dict[str, Any] = {"iteration": it}
        for route in ROUTES:
            out = share / route / f"iter-{it:06d}"
            if ctx.rank == 0:
                os.sync()  # neither pays for the write-back of the one before
            dist.barrier()
            meter = Meter(server) if server is not None else None
            if meter is not None:
                meter.mark()
            if route == "peer":
                staged = stage_sharded_weights(model, ctx, out, dtype)
                if ctx.rank == 0:
                    publish_checkpoint(unwrap(model), None, out, iteration=it,
                                       carry_files_from=model_dir, weights_from=staged,
                                       dtype=dtype)
            else:
                gathered = gather_published(model, ctx, dtype)
                if ctx.rank == 0:
                    manifest = publish_checkpoint(
                        unwrap(model), None, out, iteration=it, state_dict=gathered,
                        carry_files_from=model_dir, dtype=dtype,
                        delta_parent=out.with_name(f"iter-{it - 1:06d}") if it else None,
                        last_published=args.node_tmp / "last-published")
                    row["delta"] = manifest.delta is not None
                del gathered
            dist.barrier()
            if meter is not None:
                meter.mark()
                meter.mark()  # no fetch: the publication alone
                measured = meter.result(0, 0)
                row[route] = {"seconds": measured["update_s"], "written": measured["written"],
                              "read": measured["read"], "measured": measured["measured"]}
        if ctx.rank == 0:
            if it:  # the peer's last checkpoint is needed by nothing: 1 GB less on disk
                shutil.rmtree(share / "peer" / f"iter-{it - 1:06d}")
            rows.append(row)
    emit_row({"rank": ctx.rank, "rows": rows})


def print_row(row: dict[str, Any], model_bytes: int) -> None:
    parts = [f"iteration {row['iteration']}" + (" (ours a delta)" if row.get("delta") else "")]
    for route in ROUTES:
        r = row[route]
        parts.append(f"{route}: {r['seconds']:6.2f} s, wrote {r['written'] / model_bytes:5.3f} "
                     f"read {r['read'] / model_bytes:5.3f} x the model")
    print(" | ".join(parts), flush=True)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from benchmarks.train_memory_bench import torchrun_rows
    from benchmarks.weight_sync_bench import sshd_port, tree_bytes
    from tests.support.netfs import NetFs
    from trainer.architectures import create_model, preset

    overrides = dict(num_hidden_layers=4, vocab_size=32768) if args.quick else {}
    model_dir = create_model(root / "model", preset("qwen2", "0.5b", **overrides))
    model_bytes = tree_bytes(model_dir)
    print(f"model qwen2 0.5b{' ' + str(overrides) if overrides else ''}: "
          f"{model_bytes / MB:.0f} MB on disk; 2 ranks", flush=True)
    node_tmp = root / "node0-tmp"
    node_tmp.mkdir()
    with NetFs(root / "fs", mounts=1) as fs:
        assert fs._sshd is not None
        share = fs.mounts[0] / "run"
        share.mkdir()
        rows = torchrun_rows(2, Path(__file__), "--worker", "--model", str(model_dir),
                             "--share", str(share), "--node-tmp", str(node_tmp),
                             "--sshd-pid", str(fs._sshd.pid), "--port", str(sshd_port(fs)),
                             "--iterations", str(args.iterations), timeout_s=3600)
    iterations = next(r["rows"] for r in rows if r["rank"] == 0)
    for row in iterations:
        print_row(row, model_bytes)
    return {"model_bytes": model_bytes, "quick": args.quick, "iterations": iterations}


def summarize(result: dict[str, Any]) -> dict[str, float]:
    rows = result["iterations"]

    def moved(row: dict[str, Any], route: str) -> int:
        return int(row[route]["written"] + row[route]["read"])

    later = rows[1:]
    return {
        "bytes_full": ratio(moved(rows[0], "peer"), moved(rows[0], "ours")),
        "bytes_delta": statistics.median(ratio(moved(r, "peer"), moved(r, "ours"))
                                         for r in later),
        "time_full": ratio(rows[0]["peer"]["seconds"], rows[0]["ours"]["seconds"]),
        "time_delta": statistics.median(ratio(r["peer"]["seconds"], r["ours"]["seconds"])
                                        for r in later),
        "ours_delta_written_per_model": statistics.median(
            r["ours"]["written"] / result["model_bytes"] for r in later),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="4 layers and a 32768-token vocabulary (~180 MB of bf16)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the result here too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--share", "--node-tmp"):
        ap.add_argument(name, type=Path, help=argparse.SUPPRESS)
    for name in ("--sshd-pid", "--port"):
        ap.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        from trainer.distributed import exit_rank

        exit_rank(0)  # leaves the group; why not a plain exit: its docstring
    if args.iterations < 2:
        ap.error("--iterations: at least 2 (a full publication, then deltas)")
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="fsdp-publish-bench-"))
    try:
        result = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    summary = result["summary"] = summarize(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ours, after the first: {summary['ours_delta_written_per_model']:.3f} of the "
          f"model's bytes written per publication; wall {result['wall_s']:.0f} s")
    print(f"fsdp publish: bytes peer/ours full {summary['bytes_full']:.2f}, delta "
          f"{summary['bytes_delta']:.2f}; time peer/ours full {summary['time_full']:.2f}, "
          f"delta {summary['time_delta']:.2f}")


if __name__ == "__main__":
    main()
