"""The commands that work on this machine alone: `coordinator init-model` builds a
model, `coordinator demo` runs the loop on simulated nodes of this machine
(coordinator_cli/app.py registers them beside the commands that drive a run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from coordinator.errors import UsageError
from coordinator_cli.args import fail_usage, setup_logging
from rl.layout import INITIAL_MODEL
from trainer.architectures import WARMSTART_STEPS_BY_SIZE, Size
from trainer.config import WARMSTART_STEPS


def init_model(
    out: Annotated[Path, typer.Option(help="Directory to create (must not exist).")],
    arch: Annotated[str, typer.Option(help="char: the demo's character-level Llama (float32); qwen2 or llama: that architecture with a byte-level BPE tokenizer trained here and its chat template, in bfloat16.")] = "char",
    size: Annotated[str, typer.Option(help="With qwen2/llama: tiny (0.7 M parameters), small (5.2 M) or 0.5b (Qwen2.5-0.5B's shape, 494 M).")] = "tiny",
    hidden: Annotated[int | None, typer.Option(help="Hidden size (default: the size's).")] = None,
    intermediate: Annotated[int | None, typer.Option(help="MLP size (default: the size's).")] = None,
    layers: Annotated[int | None, typer.Option(help="Decoder layers (default: the size's).")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads (default: the size's).")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="Key/value heads (default: the size's).")] = None,
    vocab: Annotated[int | None, typer.Option(help="Vocabulary, the BPE trained to exactly this many tokens (default: the size's).")] = None,
    max_positions: Annotated[int | None, typer.Option(help="Context length (default: the size's).")] = None,
    tie_embeddings: Annotated[bool | None, typer.Option("--tie-embeddings/--no-tie-embeddings", help="lm_head is the embedding matrix (default: the size's: tied for 0.5b, as Qwen2.5-0.5B; not for tiny and small, as vLLM's CPU build reloads a tied one stale).")] = None,
    seed: Annotated[int, typer.Option(help="Weights seed.")] = 0,
    warmstart_steps: Annotated[int | None, typer.Option(help=f"Supervised warm-up steps on the built-in task (0: none; default: {WARMSTART_STEPS} for char, for qwen2/llama the size's: " + ", ".join(f"{k.value} {v}" for k, v in WARMSTART_STEPS_BY_SIZE.items()) + ").")] = None,
) -> None:
    """Create a model locally, nothing downloaded: Hugging Face format, safetensors, tokenizer,
    a manifest.  README ("A model of a real architecture, built here") shows the sizes."""
    from trainer.architectures import preset
    from trainer.warmstart import build_initial_model as build

    setup_logging(False)
    if out.exists():
        raise fail_usage(f"--out {out} already exists: give a new directory")
    if warmstart_steps is not None and warmstart_steps < 0:
        raise fail_usage(f"--warmstart-steps {warmstart_steps} is negative: use 0 to skip it")
    shape = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                 max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings)
    if arch == "char":
        if any(v is not None for v in shape.values()):
            raise fail_usage("--arch char has its fixed shape: the shape options apply to "
                             "--arch qwen2 or llama")
        spec, steps = None, WARMSTART_STEPS if warmstart_steps is None else warmstart_steps
    else:
        try:
            spec = preset(arch, size, **shape)
        except ValueError as exc:
            raise fail_usage(f"--arch {arch} --size {size}: {exc}") from None
        steps = warmstart_steps if warmstart_steps is not None else \
            WARMSTART_STEPS_BY_SIZE[Size(size)]
    try:
        report = build(out, seed=seed, warmstart_steps=steps, spec=spec)
    except ValueError as exc:  # a vocabulary the generated text cannot fill
        raise fail_usage(str(exc)) from None
    what = "tiny character model" if spec is None else (
        f"{spec.arch.value} model ({spec.parameters():,} parameters, bfloat16)")
    typer.echo(f"{what} written to {out}" + (f"; warm start: {report}" if report else ""))


def demo(
    run_dir: Annotated[Path | None, typer.Option(help="Run directory (default: runs/demo-<time>).")] = None,
    nodes: Annotated[int, typer.Option(help="Simulated nodes (daemons) on this machine.")] = 3,
    iterations: Annotated[int, typer.Option(help="RL iterations.")] = 8,
    eval_interval: Annotated[int, typer.Option(help="Evaluate every K-th iteration.")] = 2,
    engine: Annotated[str, typer.Option(help="Inference engine: hf (built in) or vllm (installed; see --vllm).")] = "hf",
    vllm: Annotated[str, typer.Option(help="With --engine vllm: the `vllm` executable to run.")] = "vllm",
    extra: Annotated[list[str], typer.Option("--set", help="Extra config: section.key=value.")] = [],  # noqa: B006
    arch: Annotated[str, typer.Option(help="The model: char (the tiny character model) or qwen2 / llama (that architecture at --size, bf16, prompted through its chat template; see init-model).")] = "char",
    size: Annotated[str, typer.Option(help="With --arch qwen2/llama: tiny or small.")] = "tiny",
) -> None:
    """Run the whole loop on simulated nodes of this machine with the tiny local model."""
    import time as _time

    from rl import demo as demo_mod
    from rl.plan import build_demo_model
    from trainer.architectures import ArchSpec, preset

    setup_logging(False)
    if nodes < 1:
        raise fail_usage(f"--nodes {nodes} is below 1: give the number of simulated nodes, e.g. 3")
    if iterations < 1:
        raise fail_usage(f"--iterations {iterations} is below 1")
    spec: ArchSpec | None = None
    if arch != "char":
        try:
            spec = preset(arch, size)
        except ValueError as exc:
            raise fail_usage(f"--arch {arch} --size {size}: {exc}") from None
        if not WARMSTART_STEPS_BY_SIZE[Size(size)]:
            raise fail_usage(f"--size {size} has {spec.parameters():,} parameters: the demo "
                             "trains on this machine's CPUs; give tiny or small")
    path = (run_dir or Path("runs") / f"demo-{_time.strftime('%Y%m%d-%H%M%S')}").absolute()
    path.mkdir(parents=True, exist_ok=True)
    model = path / INITIAL_MODEL
    if not (model / "manifest.json").exists():
        what = "tiny model" if spec is None else f"{arch} model ({size})"
        typer.echo(f"building the {what} in {model} (random init + short warm start)...")
        report = build_demo_model(model, seed=0, spec=spec, warmstart_steps=WARMSTART_STEPS
                                  if spec is None else WARMSTART_STEPS_BY_SIZE[Size(size)])
        typer.echo(f"  done: {report}")
    try:
        demo_mod.demo_config()
        engine_items = demo_mod.engine_settings(engine, vllm=vllm, nodes=nodes)
        node_env = demo_mod.node_environments(engine, vllm=vllm, nodes=nodes)
    except UsageError as exc:
        raise fail_usage(str(exc)) from None
    extra_args = [a for item in [*engine_items, *extra] for a in ("--set", item)]
    typer.echo(f"starting {nodes} nodes with the {engine} engine; run directory {path}")
    result = demo_mod.run_demo(run_dir=path, nodes=nodes, iterations=iterations,
                               eval_interval=eval_interval, extra_args=extra_args,
                               node_env=node_env)
    typer.echo(demo_mod.render_table(result.rows))
    gain = demo_mod.improvement(result.rows)
    if gain is not None:
        first, last = gain
        ratio = f"{last / first:.2f}x" if first > 0 else "n/a"
        typer.echo(f"mean reward: first 2 iterations {first:.3f}, last 2 {last:.3f} ({ratio})")
    if result.png:
        typer.echo(f"reward curve: {result.png}")
    if result.ok:
        typer.echo(f"{nodes} nodes, {iterations} iterations in {result.seconds:.0f} s")
    else:
        typer.echo(f"{nodes} nodes: the run failed after {result.seconds:.0f} s", err=True)
        for rank, code in sorted(result.codes.items()):
            if code != 0:
                typer.echo(f"node {rank} exited {code}; see {path}/demo-logs/rank-{rank}.log",
                           err=True)
        raise typer.Exit(1)
