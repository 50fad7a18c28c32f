"""`coordinator export` and `checkpoint.keep_best`, on checkpoints published as the
trainer publishes them (trainer/checkpoint.py) in a run directory's layout.

The exported directory is loaded with transformers and compared with the
checkpoint it came from, logits for logits, in fp32 and in bf16 (the dtype the
checkpoint holds is kept).  vLLM's CPU build serves an export in
tests/rollout/test_vllm_real.py (its module's one engine start), and
tests/integration/test_rl_bucket.py exports a real run's checkpoint from its bucket.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from coordinator.machine.actions import StepContext, resolve_config
from coordinator.machine.runtime import Runtime
from coordinator.records.phases import Phase
from coordinator_cli.app import app
from rl import history, keep_best, layout
from rl.actions import RlActions
from rl.reporting import end_iteration
from tests.integration.usage import coordinator
from trainer.checkpoint import MANIFEST_NAME, publish_checkpoint, seal_directory, tmp_sibling

INPUT = torch.tensor([[1, 5, 9, 14, 3, 7, 22, 4]])  # fixed token ids of the tiny vocabulary


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A run directory holding checkpoints 3 (fp32, the tokenizer files carried over
    from the initial model) and 4 (bf16, saved with its tokenizer by transformers)."""
    run = tmp_path_factory.mktemp("run")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    publish_checkpoint(model, None, layout.checkpoint(run, 3), iteration=3,
                       carry_files_from=tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    publish_checkpoint(model.to(torch.bfloat16), tokenizer, layout.checkpoint(run, 4),
                       iteration=4)
    return run


def logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([coordinator(), "export", *args], capture_output=True, text=True,
                          timeout=120)  # a few seconds: imports, then 1.5 MB copied


def test_the_newest_checkpoint_exports_as_a_plain_hf_model_with_its_logits_and_dtype(
        run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exports" / "newest"
    done = export("--run-dir", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "checkpoints/iter-000004 (the newest published checkpoint)" in done.stdout
    assert "weights BF16" in done.stdout, done.stdout
    source = layout.checkpoint(run_dir, 4)
    names = {p.name for p in out.iterdir()}
    assert names == {p.name for p in source.iterdir()} - {MANIFEST_NAME}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names
    for name in names:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert [p.name for p in out.parent.iterdir()] == ["newest"]  # no staging left
    ours, theirs = logits(out), logits(source)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.apply_chat_template(
        [{"role": "user", "content": "12>"}], add_generation_prompt=True, tokenize=False)
    # --iteration takes an older one: fp32, its tokenizer files carried from the model.
    older = tmp_path / "older"
    assert export("--run-dir", str(run_dir), "--out", str(older),
                  "--iteration", "3").returncode == 0
    assert torch.equal(logits(older), logits(layout.checkpoint(run_dir, 3)))
    assert logits(older).dtype == torch.float32
    assert AutoTokenizer.from_pretrained(older).chat_template


def test_a_file_altered_after_publishing_is_refused_and_nothing_reaches_out(
        run_dir: Path, tmp_path: Path) -> None:
    altered = tmp_path / "run"
    (altered / "checkpoints").mkdir(parents=True)
    source = layout.checkpoint(altered, 3)
    subprocess.run(["cp", "-r", str(layout.checkpoint(run_dir, 3)), str(source)], check=True)
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight: same size, other hash
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "--run-dir", str(altered), "--out", str(out)])
    assert result.exit_code == 7, result.output
    assert "iter-000003/model.safetensors: copied" in result.output
    assert "the file is altered" in result.output and "nothing was written" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no out, no staging
    weights.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    (source / "notes.txt").write_text("planted")  # and a file the manifest does not list
    result = CliRunner().invoke(app, ["export", "--run-dir", str(altered), "--out", str(out)])
    assert result.exit_code == 7 and "notes.txt: extra file not in the manifest" in result.output
    assert not out.exists()


def test_a_non_empty_out_is_refused_unless_forced_and_the_run_is_never_an_out(
        run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    invoke = CliRunner().invoke
    refused = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(out)])
    assert refused.exit_code == 2 and "is not empty" in refused.output
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    forced = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old one removed, not aside
    for inside in (run_dir.parent, run_dir / "checkpoints" / "x"):
        bad = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(inside), "--force"])
        assert bad.exit_code == 2 and "checkpoints" in bad.output, bad.output
    missing = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "n"),
                           "--iteration", "1"])
    assert missing.exit_code == 2
    assert "is not a published checkpoint" in missing.output and "present: 3, 4" in missing.output
    both = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "n"),
                        "--iteration", "3", "--best", "eval/accuracy"])
    assert both.exit_code == 2 and "give one of them" in both.output
    wrong = invoke(app, ["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "n"),
                         "--best", "train/loss"])
    assert wrong.exit_code == 2 and "only an eval metric chooses a checkpoint" in wrong.output


def write_eval(run: Path, iteration: int, **metrics: float) -> None:
    path = layout.metrics(run, iteration, "eval")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"iteration": iteration, "num_samples": 64, **metrics}))


def test_best_chooses_by_the_eval_that_measured_each_checkpoint(
        run_dir: Path, tmp_path: Path) -> None:
    # Iteration N+1 samples from and evaluates checkpoint N (iteration 0: the initial model).
    write_eval(run_dir, 0, accuracy=0.9, val_loss=0.1)  # the initial model: no checkpoint
    write_eval(run_dir, 4, accuracy=0.5, val_loss=0.9)  # checkpoint 3
    write_eval(run_dir, 5, accuracy=0.3, val_loss=0.4)  # checkpoint 4
    for metric, chosen in (("eval/accuracy", 3), ("accuracy", 3), ("eval/val_loss", 4),
                           ("eval/val_loss:max", 3), ("eval/accuracy:min", 4)):
        out = tmp_path / metric.replace("/", "-").replace(":", "-")
        result = CliRunner().invoke(app, ["export", "--run-dir", str(run_dir), "--out",
                                          str(out), "--best", metric])
        assert result.exit_code == 0, result.output
        assert f"iter-{chosen:06d}" in result.output, (metric, result.output)
        assert f"measured by iteration {chosen + 1}" in result.output
    result = CliRunner().invoke(app, ["export", "--run-dir", str(run_dir), "--out",
                                      str(tmp_path / "x"), "--best", "eval/bleu"])
    assert result.exit_code == 2 and "has an eval with bleu" in result.output


def small_checkpoint(run: Path, iteration: int) -> None:
    """A published checkpoint with a config and a weights file (phase 13 only lists them)."""
    final = layout.checkpoint(run, iteration)
    tmp = tmp_sibling(final)
    (tmp / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.full((2,), float(iteration))}, str(tmp / "model.safetensors"))
    seal_directory(tmp, final, iteration=iteration)


def context(config: object, run: Path, iteration: int) -> StepContext:
    return StepContext(rank=0, num_nodes=1, iteration=iteration, phase=Phase.FINAL_SYNC,
                       run_dir=run, run_id="run1", config=config, weights=(1.0,),  # type: ignore[arg-type]
                       host="h", address="127.0.0.1", runtime=Runtime(), timings={})


def test_phase_13_keeps_the_best_checkpoint_beside_the_newest_and_records_it(
        tmp_path: Path) -> None:
    """Eval every 2nd iteration, keep = 1, keep_best = eval/accuracy; accuracy of
    checkpoints 1, 3, 5: 0.4, 0.6, 0.5."""
    config = resolve_config({"run": {"actions": "rl"}, "metrics": {"tensorboard": False},
                             "checkpoint": {"keep": 1, "keep_best": "eval/accuracy"}})
    accuracy = {2: 0.4, 4: 0.6, 6: 0.5}  # eval of iteration N measures checkpoint N-1
    actions = RlActions(config, rank=0, num_nodes=1, run_dir=tmp_path)
    kept = {}
    try:
        for it in range(8):
            small_checkpoint(tmp_path, it)  # phase 10
            if it in accuracy:
                write_eval(tmp_path, it, accuracy=accuracy[it])  # phase 6
            end_iteration(actions.loop, context(config, tmp_path, it))  # phase 13
            kept[it] = keep_best.present(tmp_path)
    finally:
        actions.close()
    assert kept == {0: [0], 1: [1], 2: [1, 2], 3: [1, 3], 4: [3, 4], 5: [3, 5], 6: [3, 6],
                    7: [3, 7]}
    record = json.loads(layout.best_checkpoint(tmp_path).read_text())
    assert record == {"schema": "coordinator/best-checkpoint", "version": 1,
                      "metric": "eval/accuracy", "better": "higher", "iteration": 3,
                      "value": 0.6, "evaluated_at": 4}
    # `coordinator status` shows it per iteration (the rl kind's rows).
    for it in range(8):
        write_eval(tmp_path, it, accuracy=accuracy.get(it, 0.0))
    states = {r["iteration"]: r["checkpoint"] for r in history.report(tmp_path, 8)}
    assert states == {0: None, 1: None, 2: None, 3: "best (0.6)", 4: None, 5: None, 6: None,
                      7: "kept"}
    # The export takes the record's choice.
    out = tmp_path / "best"
    result = CliRunner().invoke(app, ["export", "--run-dir", str(tmp_path), "--out", str(out),
                                      "--best", "eval/accuracy"])
    assert result.exit_code == 0, result.output
    assert "the best by checkpoint.keep_best, iter-000003: eval/accuracy 0.6" in result.output


def test_keep_best_refuses_a_name_that_is_no_eval_metric() -> None:
    from coordinator.errors import UsageError

    for bad, words in (("rollout/reward_mean", "is a rollout metric"),
                       ("eval/num_samples", "counts the eval's work"),
                       ("eval/accuracy:up", "give max (higher is better) or min")):
        with pytest.raises(UsageError, match=re.escape(words)):
            resolve_config({"run": {"actions": "rl"}, "checkpoint": {"keep_best": bad}})


def test_an_os_error_is_told_as_the_outs_or_the_checkpoints_by_its_path(tmp_path: Path) -> None:
    from rl.export import writes_to

    out = tmp_path / "exports" / "model"
    for name, writing in ((out / "config.json", True), (out.parent, True),
                          (out.parent / ".model.export-7-00ff/model.safetensors", True),
                          (out.parent / ".other/x", False),
                          (out.parent / "run/checkpoints/iter-000001/config.json", False)):
        assert writes_to(OSError(28, "No space left on device", str(name)), out) is writing, name
    assert not writes_to(OSError(5, "Input/output error"), out)  # names no path


def test_a_delta_checkpoint_exports_whole_as_the_trainer_wrote_it(
        run_dir: Path, tmp_path: Path) -> None:
    """The newest checkpoint of a run with checkpoint.full_every > 1 is usually a delta
    (trainer/delta.py): it is made whole from its chain, never exported as a delta."""
    import shutil

    run, last = tmp_path / "run", tmp_path / "trainer-disk"
    shutil.copytree(layout.checkpoints(run_dir), layout.checkpoints(run))
    model = AutoModelForCausalLM.from_pretrained(layout.checkpoint(run, 4), dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(layout.checkpoint(run, 4))
    publish_checkpoint(model, tokenizer, layout.checkpoint(run, 5), iteration=5,
                       last_published=last)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.view(-1)[::50] += 0.25  # 2 % of the elements: an RL step
    manifest = publish_checkpoint(model, tokenizer, layout.checkpoint(run, 6), iteration=6,
                                  last_published=last, delta_parent=layout.checkpoint(run, 5))
    assert manifest.delta is not None
    out = tmp_path / "exports" / "newest"
    done = export("--run-dir", str(run), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "checkpoints/iter-000006 (the newest published checkpoint)" in done.stdout
    assert "model.safetensors" in {p.name for p in out.iterdir()} and not (out / "delta").exists()
    assert (out / "model.safetensors").read_bytes() == (last / "model.safetensors").read_bytes()
    with torch.no_grad():
        assert torch.equal(logits(out), model.eval()(input_ids=INPUT).logits)
    assert [p.name for p in out.parent.iterdir()] == ["newest"]  # no staging left


def test_a_checkpoint_without_its_manifest_is_never_offered(tmp_path: Path) -> None:
    """iter-3 still publishing (or left by a failed publish): refused, and the list of
    what may be given names only the published ones (it used to offer 3 too)."""
    run = tmp_path / "run"
    for iteration in (1, 2):
        small_checkpoint(run, iteration)
    layout.checkpoint(run, 3).mkdir()
    (layout.checkpoint(run, 3) / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["export", "--run-dir", str(run), "--out",
                                      str(tmp_path / "out"), "--iteration", "3"])
    assert result.exit_code == 2, result.output
    assert "is not a published checkpoint" in result.output
    assert "give one of the checkpoints present: 1, 2" in " ".join(result.output.split())
