"""A reward function in a Python file (reward.path), verl's way: checked at start,
called in a worker process with the task's data as stored, its dict's numbers
averaged into the metrics; the same timeout and failure rules as the math reward."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.errors import RewardFileError
from rollout.reward_file import FileReward, close_workers
from rollout.reward_tally import RewardTally, tallying
from rollout.rewards import Score
from rollout.tasks import Task
from rollout.wire import GroupResult, Sample

PROJECT = Path(__file__).resolve().parents[2]
GSM8K_REWARD = PROJECT / "examples" / "rewards" / "gsm8k.py"


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    """Every test's reward workers are stopped: no child outlives its test."""
    yield
    close_workers()


def reward_file(tmp_path: Path, body: str, name: str = "reward.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def task(truth: object = "7", extra: object = None, source: str = "openai/gsm8k") -> Task:
    return Task(task_id=f"{source}/train/0", prompt="q", ground_truth=str(truth),
                data_source=source, split="train", stored_truth=truth, extra_info=extra)


def group(*texts: str) -> GroupResult:
    return GroupResult(index=0, prompt="q", samples=tuple(
        Sample(text=t, token_ids=(1,), logprobs=(-0.1,), prompt_token_ids=(5,),
               finish_reason="stop") for t in texts))


ECHO = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth["answer"]),
                "index": extra_info["index"], "long": len(solution_str) > 3,
                "source_ok": data_source == "openai/gsm8k", "note": "ignored",
                "nan": float("nan")}
"""


def test_the_function_gets_the_data_as_stored_and_its_dicts_numbers_are_kept(
        tmp_path: Path) -> None:
    reward = FileReward(path=str(reward_file(tmp_path, ECHO)))
    identity = reward.check()
    assert identity.startswith("compute_score in a file of SHA-256 ")
    scored = reward.score(task({"answer": "12"}, {"index": 4, "split": "train"}), "12")
    # The ground truth and extra_info arrive as the data holds them (an object each);
    # bools count as numbers, strings and non-finite values are left out.
    assert scored == Score(1.0, {"index": 4.0, "long": 0.0, "source_ok": 1.0})
    assert reward.score(task({"answer": "12"}, {"index": 5}), "wrong").value == 0.0


def test_a_float_result_and_keyword_parameters_in_any_order_work(tmp_path: Path) -> None:
    path = reward_file(tmp_path, """
        import numpy as np

        def score_it(extra_info, ground_truth, solution_str, data_source, **kwargs):
            right = solution_str == ground_truth and data_source == "openai/gsm8k"
            return np.float32(0.5) if right and extra_info is None else 0
    """)
    reward = FileReward(path=str(path), function="score_it")
    reward.check()
    assert reward.score(task("7"), "7") == Score(0.5)
    assert reward.score(task(7), "7") == Score(0.0)  # the number 7 as stored, not "7"


@pytest.mark.parametrize(("body", "function", "message"), [
    ("x = 1\n", "compute_score",
     r"it defines no 'compute_score' \(its functions: none\): name one with reward.function"),
    ("def other(a): pass\ndef helper(): pass\n", "compute_score",
     r"its functions: helper, other\)"),
    ("def compute_score(data_source, solution_str, ground_truth):\n    return 0\n",
     "compute_score", r"compute_score\(data_source, solution_str, ground_truth\) cannot be "
     r"called as compute_score\(data_source=\.\.\., solution_str=\.\.\., ground_truth=\.\.\., "
     r"extra_info=\.\.\.\)"),
    ("async def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
     "    return 0\n", "compute_score", "is 'async def'"),
    ("raise RuntimeError('no API key')\n", "compute_score",
     r"running the file raised RuntimeError: no API key"),
    ("compute_score = 3\n", "compute_score", "compute_score is a int, not a function"),
])
def test_a_file_that_cannot_score_is_refused_at_the_check_naming_the_problem(
        tmp_path: Path, body: str, function: str, message: str) -> None:
    path = reward_file(tmp_path, body)
    with pytest.raises(RewardFileError, match=message) as info:
        FileReward(path=str(path), function=function).check()
    assert str(info.value).startswith(f"reward.path {str(path)!r}: ")


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RewardFileError, match=r"reward.path '.*absent.py' is not a file here"):
        FileReward(path=str(tmp_path / "absent.py")).check()


def test_a_symlinked_reward_file_is_followed(tmp_path: Path) -> None:
    target = reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, "
                         "extra_info=None):\n    return 1\n", name="real.py")
    link = tmp_path / "link.py"
    link.symlink_to(target)
    reward = FileReward(path=str(link))
    assert reward.check() == FileReward(path=str(target)).identity()
    assert reward.score(task(), "x") == Score(1.0)


def test_a_result_that_is_no_score_fails_its_sample_naming_the_rule(tmp_path: Path) -> None:
    from rollout.sampling_agent import samples_of

    path = reward_file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "dict":
                return {"acc": 1.0}
            if solution_str == "text":
                return "right"
            if solution_str == "raise":
                raise KeyError("answer")
            if solution_str == "nan":
                return float("nan")
            return {"score": 1, "n": 2}
    """)
    reward = FileReward(path=str(path))
    with tallying(RewardTally()) as tally:
        out = samples_of(task(), group("ok", "dict", "text", "raise", "nan"), 5, reward.score,
                         reward_name=reward.name)
    assert [s.failed for s in out] == [False, True, True, True, True]
    assert (tally.calls, tally.timeouts) == (5, 0)  # every call counted, none timed out
    assert out[0].reward == 1.0 and out[0].reward_extra == {"n": 2.0}
    assert "compute_score returned a dict without 'score' (keys: acc)" in out[1].error
    assert "compute_score returned 'right' (a str): return a number, or a dict" in out[2].error
    assert f"the reward '{reward.name}' raised GuardedCallError: reward {reward.name}: " \
           "KeyError: 'answer'" in out[3].error
    assert "gave nan, not a finite number" in out[4].error


def test_a_call_that_runs_out_of_time_scores_zero_and_is_counted(tmp_path: Path) -> None:
    path = reward_file(tmp_path, """
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(float(solution_str))
            return 1.0
    """)
    reward = FileReward(path=str(path), timeout_s=1.0)
    reward.check()
    with tallying(RewardTally()) as tally:
        assert reward.score(task(), "0").value == 1.0
        start = time.monotonic()
        assert reward.score(task(), "600").value == 0.0  # killed at 1 s
        assert time.monotonic() - start < 20  # a loaded machine; far below 600
        assert reward.score(task(), "0").value == 1.0  # a new worker scores the next one
    assert (tally.calls, tally.timeouts) == (3, 1)


def test_a_reward_whose_worker_dies_fails_its_sample_naming_how(tmp_path: Path) -> None:
    from rollout.reward_file import _worker
    from rollout.sampling_agent import samples_of

    path = reward_file(tmp_path, """
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(float(solution_str))
            return 1.0
    """)
    reward = FileReward(path=str(path))
    reward.check()
    pid = _worker(reward).pid
    assert pid is not None
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))  # as the OOM killer would
    killer.start()
    try:
        (out,) = samples_of(task(), group("30"), 1, reward.score, reward_name=reward.name)
    finally:
        killer.cancel()
    assert out.failed and "died during the call: killed by SIGKILL" in out.error, out.error


def test_the_worker_costs_well_under_a_millisecond_a_call(tmp_path: Path) -> None:
    """The JSON line each way per answer, measured: the price of the deadline."""
    reward = FileReward(path=str(GSM8K_REWARD))
    reward.check()
    calls = 500
    start = time.perf_counter()
    for i in range(calls):
        reward.score(task(str(i)), f"so #### {i}")
    per_call = (time.perf_counter() - start) / calls
    print(f"reward file call: {per_call * 1e6:.0f} us")
    assert per_call < 0.005  # 5 ms on a loaded 2-core machine; about 0.1 ms idle


@pytest.mark.parametrize(("response", "truth", "expected"), [
    ("48/2 = 24 clips.\n#### 72", "72", {"score": 1.0, "acc": True, "formatted": True}),
    ("#### 1,000", "1000", {"score": 1.0, "acc": True, "formatted": True}),
    ("#### 3 then #### 4.0", 4, {"score": 1.0, "acc": True, "formatted": True}),
    ("The answer is 72", "72", {"score": 0.0, "acc": False, "formatted": False}),
    ("#### 71", "72", {"score": 0.0, "acc": False, "formatted": True}),
])
def test_the_gsm8k_example_takes_the_number_after_the_last_marks(
        response: str, truth: object, expected: dict) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_example", GSM8K_REWARD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module.compute_score("openai/gsm8k", response, truth, {"index": 0})
    assert {k: got[k] for k in expected} == expected


def test_a_chunk_keeps_each_samples_reward_metrics_and_refuses_hostile_ones(
        tmp_path: Path) -> None:
    import torch

    from coordinator.errors import MalformedRecordError
    from rollout.chunk_format import FinishReason, TrajectorySample, decode_chunk, encode_chunk

    def sample(i: int, extra: dict[str, float]) -> TrajectorySample:
        return TrajectorySample(task_id="t/0", sample_index=i, prompt_token_ids=[1],
                                response_token_ids=[2], response_logprobs=[-0.5],
                                response_text="x", reward=1.0, finish_reason=FinishReason.STOP,
                                reward_extra=extra)

    payload = encode_chunk([[sample(0, {"acc": 1.0}), sample(1, {"len": 3.0})]], rank=0,
                           iteration=0)
    chunk = decode_chunk(payload, path=tmp_path / "c.pt")
    assert [s.reward_extra for s in chunk.samples()] == [{"acc": 1.0}, {"len": 3.0}]
    for bad, message in (({"a b": torch.zeros(2)}, "'a b', not a metric name"),
                         ({"acc": torch.zeros(3)}, "one value per sample")):
        with pytest.raises(MalformedRecordError, match=message):
            decode_chunk({**payload, "reward_extra": bad}, path=tmp_path / "c.pt")
    with pytest.raises(ValueError, match="'a b' is not a metric name"):
        sample(0, {"a b": 1.0})
    assert json.loads(json.dumps(chunk.samples().__next__().reward_extra)) == {"acc": 1.0}


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[object]:
    """The hf server on the tiny model (chat template included), in this process."""
    from rollout.agents import EngineEndpoint
    from rollout.client import CompletionClient
    from rollout.hf.server import Generator, Server

    server = Server(("127.0.0.1", 0), api_key="k", model_name="policy")
    server.attach(Generator(tiny_model, device="cpu", dtype="auto", max_batch=8, seed=0,
                            max_model_len=None), tiny_model)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield EngineEndpoint(base, "k", "policy", CompletionClient(base, "k", model="policy"))
    server.shutdown()
    server.server_close()


def test_a_gsm8k_reward_file_scores_a_gsm8k_parquet_through_rollout_and_aggregation(
        tmp_path: Path, engine: object) -> None:
    """verl's layout end to end: a generated GSM8K-style parquet (data_source, chat
    prompt, ability, reward_model, extra_info), the real engine through its chat
    template, built-in sampling scoring with examples/rewards/gsm8k.py in its worker,
    the rank's chunks, and the master's aggregation into the batch and its metrics."""
    import importlib.util

    import pyarrow.parquet as pq

    from examples.gsm8k_style import SHORT_INSTRUCTION, write
    from rollout.aggregate import aggregate_iteration
    from rollout.sampling_agent import SingleTurnSampler
    from rollout.task_files import load_task_files
    from rollout.train_batch import load_train_batch
    from rollout.trajectory import RankCheckpointWriter

    files = write(tmp_path / "gsm8k", train=6, test=0, seed=0, instruction=SHORT_INSTRUCTION)
    assert pq.read_schema(files["train"]).names == ["data_source", "prompt", "ability",
                                                    "reward_model", "extra_info"]
    tasks = list(load_task_files([str(files["train"])], []).tasks("train"))
    reward = FileReward(path=str(GSM8K_REWARD))
    reward.check()
    sampler = SingleTurnSampler(max_tokens=12, temperature=1.0, top_p=1.0, reward="",
                                seed_of=lambda t: 7, reward_file=reward)
    writer = RankCheckpointWriter(tmp_path / "rank-0", 0, 2, iteration=0)
    with tallying(RewardTally()) as tally:
        for _, samples in sampler.run_groups(tasks, engine,  # type: ignore[arg-type]
                                             group_size=4, check_cancel=lambda: None):
            writer.add_group(samples)
    writer.finalize()
    assert (tally.calls, tally.timeouts) == (24, 0)
    metrics = aggregate_iteration({0: tmp_path / "rank-0"}, {0: [t.task_id for t in tasks]},
                                  iteration=0, group_size=4, out_path=tmp_path / "batch.pt")

    # Each answer scored as the file's compute_score scores its text, here, in-process.
    spec = importlib.util.spec_from_file_location("gsm8k_here", GSM8K_REWARD)
    assert spec is not None and spec.loader is not None
    here = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(here)
    from rollout.chunk_format import read_verified_chunk

    by_id = {t.task_id: t for t in tasks}
    verdicts = []
    for entry in writer.manifest.chunks:
        for s in read_verified_chunk(tmp_path / "rank-0" / entry.file, entry).samples():
            assert not s.failed, s.error
            task = by_id[s.task_id]
            expected = here.compute_score(task.data_source, s.response_text, task.truth,
                                          task.extra_info)
            assert s.reward == expected["score"]
            assert s.reward_extra == {"acc": float(expected["acc"]),
                                      "formatted": float(expected["formatted"])}
            verdicts.append(expected)
    assert len(verdicts) == 24
    # The dict's numbers, averaged into the iteration's metrics; its string left out.
    assert metrics.reward_extra == pytest.approx({
        "acc": sum(v["acc"] for v in verdicts) / 24,
        "formatted": sum(v["formatted"] for v in verdicts) / 24})
    assert json.loads(metrics.to_json())["reward_extra"].keys() == {"acc", "formatted"}
    assert metrics.num_train_samples == 24 and len(load_train_batch(tmp_path / "batch.pt")
                                                   .task_ids) == 24

    from rl.reporting import reward_scalars

    assert reward_scalars("rollout", json.loads(metrics.to_json())) == pytest.approx({
        "rollout/reward/acc": metrics.reward_extra["acc"],
        "rollout/reward/formatted": metrics.reward_extra["formatted"]})
    assert reward_scalars("eval", {"reward_extra": {"../x": 1.0, "ok": 2, "s": "a"}}) == {
        "eval/reward/ok": 2.0}
