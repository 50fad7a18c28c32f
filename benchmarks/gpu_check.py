"""The FSDP2 training path on this machine's GPUs: NCCL, bf16, sharded loading, one step,
one checkpoint saved and loaded back.  Run it on a GPU node before a real run:

    python benchmarks/gpu_check.py                      # every local GPU, ~1.1 GB model
    python benchmarks/gpu_check.py --hidden 2048 --layers 16

Each GPU is one torchrun rank.  A Llama of the given shape (random weights) is
written as safetensors; every rank loads only its shards
(trainer/sharded_load.py), runs one forward, backward and AdamW step on a
random batch in bf16 compute, then the checkpoint is saved the way the trainer
publishes it (every tensor gathered onto rank 0, or every rank's shards
consolidated by rank 0 where the model would not fit in its memory:
trainer/sharded_save.py; SHA-256 manifest), every saved tensor is compared with
the trained parameter bit for bit, and the checkpoint is loaded back with
from_pretrained and run as the trainer ran (same device, same compute dtype) to
compare the logits.  Printed per rank: peak
GPU memory (torch.cuda.max_memory_allocated) after loading and after the step,
the step time, and the logit difference.  Then two iterations as the resident
trainer runs them, offloading weights, grads and optimizer state to CPU memory
between them: printed, the GPU memory each rank still holds while offloaded
(the engine's time), and whether the weights came back unchanged.  Then, where a
`vllm` executable is found (`--vllm`, default: the one on PATH), a delta update into a
running vLLM engine on this machine, timed (benchmarks/vllm_delta_update.py: the
trainer's step published as a delta, made whole in the node's cache, reloaded in
place, the served weights checked by probes).  Exit 0 when the checkpoint matches,
every round trip is exact and the engine serves the delta's weights.

`--device cpu` runs the same code on gloo ranks (fp32): what CI checks here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# max |logit difference| over max(1, max |logit|): a bf16 logit carries 8 significant
# bits (a relative step of 2**-8 to 2**-7), and the trainer's FSDP2 casts its weights
# to bf16 where the reloaded model autocasts op by op: a few steps apart at most.
TOLERANCE = {"cuda": 2e-2, "cpu": 1e-4}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import publish_checkpoint, verify_checkpoint
    from trainer.config import TrainConfig
    from trainer.distributed import init_distributed, unwrap
    from trainer.grpo import collate
    from trainer.policy import forward_logits, load_policy
    from trainer.sharded_save import published_weights

    cuda = args.device == "cuda"
    config = TrainConfig.from_dict({"strategy": "fsdp2", "device": args.device,
                                    "dtype": "bfloat16" if cuda else "float32"})
    ctx = init_distributed(config)
    torch.manual_seed(0)
    model_dir, out_dir = Path(args.model), Path(args.out)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, _ = load_policy(model_dir, ctx, trainable=True)
    load_peak = torch.cuda.max_memory_allocated() if cuda else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq))
    if cuda:
        torch.cuda.synchronize()
    started = time.monotonic()
    out = model(input_ids=ids.to(ctx.device), labels=ids.to(ctx.device))
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    step_s = time.monotonic() - started
    step_peak = torch.cuda.max_memory_allocated() if cuda else 0
    # As the trainer publishes it: gathered onto rank 0, or where it would not fit in
    # rank 0's memory, every rank's shards staged and consolidated by rank 0.
    gathered, staged = published_weights(model, ctx, out_dir, None) if ctx.is_distributed \
        else (None, None)
    if ctx.rank == 0:
        publish_checkpoint(unwrap(model), None, out_dir, iteration=0, state_dict=gathered,
                           carry_files_from=model_dir, weights_from=staged)
    if ctx.is_distributed:
        dist.barrier()
    verify_checkpoint(out_dir)
    unequal = unequal_weights(model, out_dir, ctx)
    probe = collate([[5, 6, 7, 8]] * 2, [[9, 10, 11]] * 2, pad_id=0)
    model.eval()
    with torch.no_grad():
        ours = forward_logits(model, probe, ctx).float().cpu()
    diff = scale = None
    if ctx.rank == 0:
        from transformers import AutoModelForCausalLM

        # Loaded back as a rollout node or an export reads it, and run as the trainer
        # ran: on this device, in its compute dtype (bf16 on a GPU).  The weights are
        # compared exactly above; these logits show the checkpoint loads to the same
        # model (config, tied embeddings), to within the compute dtype's rounding.
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        reloaded.to(ctx.device).eval()
        with torch.no_grad(), torch.autocast(ctx.device.type, dtype=ctx.compute_dtype,
                                             enabled=cuda):
            theirs = reloaded(input_ids=probe.input_ids.to(ctx.device),
                              attention_mask=probe.attention_mask.to(ctx.device)
                              ).logits.float().cpu()
        diff = float((ours - theirs).abs().max())
        scale = float(theirs.abs().max())
        del reloaded  # off the GPU before the offload's memory is measured
        if cuda:
            torch.cuda.empty_cache()
    resident = resident_iterations(ctx, config, model, optimizer, ids, probe, ours)
    from benchmarks.train_memory_bench import emit_row

    emit_row({"rank": ctx.rank, "load_peak": load_peak, "step_peak": step_peak,
              "step_s": step_s, "loss": float(out.loss.detach()), "max_logit_diff": diff,
              "max_logit": scale, "unequal_weights": unequal, **resident})


def unequal_weights(model: Any, out_dir: Path, ctx: Any) -> list[str] | None:
    """The names of the trained parameters that the published checkpoint does not hold
    bit for bit (rank 0; None on the others).  Every rank gathers each FSDP2 shard in
    the same order (full_tensor is a collective)."""
    import torch
    from safetensors.torch import load_file

    from trainer.distributed import unwrap

    saved: dict[str, Any] = {}
    if ctx.rank == 0:
        for path in sorted(out_dir.glob("*.safetensors")):
            saved.update(load_file(path))
    unequal = []
    for name, param in unwrap(model).named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if ctx.rank != 0:
            continue
        kept = saved.get(name)
        if kept is None or not torch.equal(full.detach().cpu().to(kept.dtype), kept):
            unequal.append(name)
    return unequal if ctx.rank == 0 else None


def resident_iterations(ctx: Any, config: Any, model: Any, optimizer: Any, ids: Any, probe: Any,
                        before: Any) -> dict[str, Any]:
    """Two iterations as the resident trainer runs them (trainer/session.py): back onto
    the GPU, one step, then weights, grads and optimizer state to CPU memory.  Returns
    what the process still holds on the GPU while offloaded (the engine's time), and
    whether the weights came back from CPU memory unchanged."""
    import dataclasses

    import torch

    from trainer.policy import forward_logits
    from trainer.session import Session

    session = Session(ctx=ctx, config=dataclasses.replace(config, offload="on"), model=model,
                      tokenizer=None, optimizer=optimizer)
    cuda = ctx.device.type == "cuda"
    held, round_trip = [], True
    for _ in range(2):
        session.offload()
        held.append(torch.cuda.memory_reserved() if cuda else 0)
        session.onload()
        model.eval()
        with torch.no_grad():
            again = forward_logits(model, probe, ctx).float().cpu()
        round_trip = round_trip and bool(torch.equal(again, before))
        model.train()
        out = model(input_ids=ids.to(ctx.device), labels=ids.to(ctx.device))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            before = forward_logits(model, probe, ctx).float().cpu()
    session.offload()
    return {"offloaded_reserved": max(held), "offload_round_trip_exact": round_trip,
            "offloads": session.offloads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", type=int, default=0, help="default: every local GPU (cpu: 2)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--vllm", default=shutil.which("vllm") or "",
                        help="the vllm executable for the delta update (default: the one on "
                             "PATH; none: that step is skipped)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from trainer.distributed import exit_rank

        exit_rank(0)  # leaves the group; why not a plain exit: its docstring
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible here: run it on a GPU node (or pass "
              "--device cpu to run the same path on gloo ranks)", file=sys.stderr)
        return 2
    ranks = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    from benchmarks.train_memory_bench import build_model, torchrun_rows

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model, out = Path(tmp) / "model", Path(tmp) / "checkpoint"
        size = build_model(model, hidden=args.hidden, intermediate=4 * args.hidden,
                           layers=args.layers, heads=args.heads)
        try:
            rows = torchrun_rows(
                ranks, Path(__file__).resolve(), "--worker", "--model", str(model), "--out",
                str(out), "--device", args.device, "--batch", str(args.batch), "--seq",
                str(args.seq), "--vocab", str(args.vocab), timeout_s=3600)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        if len(rows) != ranks:
            print(f"gpu_check: {len(rows)} of {ranks} ranks reported a result", file=sys.stderr)
            return 1
    print(f"model {size / 2**20:.0f} MiB fp32 on {ranks} {args.device} rank(s), batch "
          f"{args.batch} x {args.seq}")
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(f"rank {r['rank']}: peak after load {r['load_peak'] / 2**20:.0f} MiB, after "
              f"step {r['step_peak'] / 2**20:.0f} MiB, step {r['step_s']:.2f} s, loss "
              f"{r['loss']:.4f}")
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(f"rank {r['rank']}: resident trainer, 2 iterations with offload "
              f"({'on' if r['offloads'] else 'nothing moves on CPU'}): GPU memory still "
              f"reserved while the engine has the GPU {r['offloaded_reserved'] / 2**20:.0f} MiB; "
              f"weights back from CPU memory unchanged: {r['offload_round_trip_exact']}")
    first = next(r for r in rows if r["rank"] == 0)
    diff, unequal = first["max_logit_diff"], first["unequal_weights"]
    tolerance = TOLERANCE[args.device] * max(1.0, first["max_logit"])
    ok = diff is not None and diff <= tolerance and not unequal and all(
        r["offload_round_trip_exact"] for r in rows)
    print(f"checkpoint saved: every trained parameter bit for bit: "
          f"{'yes' if not unequal else 'NO, ' + ', '.join(unequal[:5])}")
    print(f"checkpoint reloaded and run as trained: max |logit difference| {diff:.2e} of "
          f"logits up to {first['max_logit']:.2f} ({'OK' if ok else 'MISMATCH'}, tolerance "
          f"{tolerance:.2e})")
    return 0 if ok and vllm_delta(args) else 1


def vllm_delta(args: argparse.Namespace) -> bool:
    """The delta update into vLLM (benchmarks/vllm_delta_update.py), where an executable
    is found; whether it passed (True when skipped)."""
    from benchmarks import vllm_delta_update

    if not args.vllm or not Path(args.vllm).exists():
        print(f"vllm delta update: skipped, no vllm executable ({args.vllm or 'none on PATH'}; "
              "pass --vllm PATH)")
        return True
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        try:
            result = vllm_delta_update.run(Path(args.vllm), args.device, Path(tmp),
                                           small=args.device == "cpu")
        except RuntimeError as exc:
            print(f"vllm delta update: FAILED: {exc}")
            return False
    vllm_delta_update.report(result)
    return True


if __name__ == "__main__":
    sys.exit(main())
