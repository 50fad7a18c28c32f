"""Peak memory per trainer rank: loading the model, and one training step.

    python benchmarks/train_memory_bench.py                   # ~500 MB model, 1/2/4 ranks
    python benchmarks/train_memory_bench.py --hidden 512 --layers 8 --ranks 4

A Llama of the given shape (random weights, the tiny model's tokenizer) is
written once as safetensors; then, for each rank count, torchrun starts that
many gloo ranks on this machine, each of which, in turn:

    full      today's path before sharded loading: from_pretrained (the whole
              model, fp32) on every rank, then FSDP2 fully_shard
    sharded   trainer/sharded_load.py: parameters on meta, fully_shard,
              to_empty, each rank reading only its rows with safe_open

and reports the growth of its peak resident memory (VmHWM after the kernel's
peak was reset through /proc/self/clear_refs, minus VmRSS before) while loading
(the full path's mapped weights touched, as a GPU rank copies them all),
and then during one forward, backward and AdamW step on a random batch (with and
without activation checkpointing).  Printed against the model's full fp32 size:
the sharded load at 4 ranks should grow each rank by about 1/4 of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset the kernel's peak-RSS mark; returns the resident size now."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: load, step, print one JSON line."""
    import torch

    from trainer.config import TrainConfig
    from trainer.distributed import init_distributed, unwrap
    from trainer.policy import enable_checkpointing, load_model
    from trainer.sharded_load import load_sharded_model

    config = TrainConfig.from_dict({"strategy": "fsdp2", "device": "cpu"})
    ctx = init_distributed(config)
    torch.manual_seed(0)
    # Imports and one-time allocations out of the measurement: the model classes,
    # the tokenizer, a model built with every parameter on meta.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trainer.sharded_load import parameters_on_meta

    AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    with parameters_on_meta():
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    before = _reset_peak()
    if args.mode == "sharded":
        model = load_sharded_model(Path(args.model), ctx, trainable=True)
    else:
        from trainer.distributed import wrap_model

        full, _ = load_model(Path(args.model), ctx)
        # transformers maps the safetensors file and reads pages on first use; a GPU
        # rank copies every weight to the device at once: touch them all here too.
        with torch.no_grad():
            for p in full.parameters():
                p.sum()
        model = wrap_model(full, ctx, trainable=True)
        del full
    load_peak = _status("VmHWM") - before
    ref_peak = 0
    if args.mode == "sharded" and args.reference:
        # kl_coef > 0: the frozen reference model, loaded the same way next to it.
        before = _reset_peak()
        reference = load_sharded_model(Path(args.model), ctx, trainable=False)
        ref_peak = _status("VmHWM") - before
        del reference
    if args.checkpointing:
        enable_checkpointing(unwrap(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    before = _reset_peak()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    step_peak = _status("VmHWM") - before
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                for p in model.parameters())
    emit_row({"rank": ctx.rank, "mode": args.mode, "checkpointing": args.checkpointing,
              "load_peak": load_peak, "ref_peak": ref_peak, "step_peak": step_peak,
              "local_bytes": local, "loss": float(out.loss)})


def build_model(out: Path, *, hidden: int, intermediate: int, layers: int, heads: int) -> int:
    """A Llama of this shape in Hugging Face format; returns its fp32 size in bytes."""
    from trainer.tiny_model import TinyModelSpec, create_tiny_model

    spec = TinyModelSpec(hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         max_position_embeddings=512)
    create_tiny_model(out, seed=0, spec=spec)
    return (out / "model.safetensors").stat().st_size


ROWS_DIR = "BENCH_ROWS_DIR"


def emit_row(row: dict[str, Any]) -> None:
    """One torchrun rank's result, as a file of its own: torchrun merges the ranks' stdout,
    and two ranks printing at once can share a line."""
    Path(os.environ[ROWS_DIR], f"rank-{row['rank']}.json").write_text(json.dumps(row))


def torchrun_rows(ranks: int, script: Path, *args: str, timeout_s: float = 1800
                  ) -> list[dict[str, Any]]:
    """`script` on `ranks` local torchrun ranks; the row each rank emitted (emit_row)."""
    with tempfile.TemporaryDirectory(prefix="bench-rows-") as rows:
        from rollout.engines.process import python_path

        # The repository first, then whatever PYTHONPATH the caller set (packages it
        # installed beside the interpreter's own, say).
        env = {**os.environ, "OMP_NUM_THREADS": "1", ROWS_DIR: rows,
               "PYTHONPATH": python_path(str(HERE.parent), os.environ.get("PYTHONPATH"))}
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
             "--master-port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
             str(script), *args], capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(rows).glob("rank-*.json"))]


def measure(model: Path, *, ranks: int, mode: str, checkpointing: bool, batch: int, seq: int,
            vocab: int) -> list[dict[str, Any]]:
    return torchrun_rows(
        ranks, Path(__file__).resolve(), "--worker", "--model", str(model), "--mode", mode,
        "--batch", str(batch), "--seq", str(seq), "--vocab", str(vocab),
        *(["--checkpointing"] if checkpointing else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="")
    parser.add_argument("--mode", default="sharded", choices=("full", "sharded"))
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--reference", action="store_true",
                        help="worker: also load the frozen reference model (sharded path)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=0, help="default 4 x hidden")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from trainer.distributed import exit_rank

        exit_rank(0)  # leaves the group; why not a plain exit: its docstring
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        model = Path(tmp) / "model"
        size = build_model(model, hidden=args.hidden, intermediate=args.intermediate or
                           4 * args.hidden, layers=args.layers, heads=args.heads)
        print(f"model: hidden {args.hidden}, {args.layers} layers, {size / 2**20:.0f} MiB of "
              f"fp32 weights; step: batch {args.batch} x {args.seq} tokens")
        print(f"{'ranks':>5} {'path':>8} {'ckpt':>5} {'load peak/rank':>15} {'x model':>8} "
              f"{'step peak/rank':>15} {'x model':>8}")
        for ranks in (int(r) for r in args.ranks.split(",")):
            for mode in ("full", "sharded"):
                for checkpointing in ((False, True) if mode == "sharded" else (False,)):
                    rows = measure(model, ranks=ranks, mode=mode, checkpointing=checkpointing,
                                   batch=args.batch, seq=args.seq, vocab=args.vocab)
                    load = max(r["load_peak"] for r in rows)
                    step = max(r["step_peak"] for r in rows)
                    print(f"{ranks:>5} {mode:>8} {'on' if checkpointing else 'off':>5} "
                          f"{load / 2**20:>11.0f} MiB {load / size:>8.2f} "
                          f"{step / 2**20:>11.0f} MiB {step / size:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
