"""/v1/chat/completions on the hf server, driven by the official `openai` client.

Agent code is written against the OpenAI chat API; these requests are what
such code sends, unchanged.  The answer must carry the exact tokens the model
produced (return_token_ids, logprobs): checked against the model itself,
token by token, by teacher forcing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.hf.server import Generator, Server
from trainer.tiny_model import create_tiny_model

KEY = "k"
CHAT: list[Any] = [{"role": "system", "content": "reverse the digits"},
        {"role": "user", "content": [{"type": "text", "text": "reverse 123"}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("models") / "m", seed=3)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[openai.OpenAI]:
    server = Server(("127.0.0.1", 0), api_key=KEY, model_name="policy")
    generator = Generator(model_dir, device="cpu", dtype="auto", max_batch=8, seed=0,
                          max_model_len=None)
    server.attach(generator, model_dir)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                        api_key=KEY, max_retries=0, timeout=60)
    server.shutdown()
    server.server_close()


def test_an_openai_chat_request_gets_the_models_exact_tokens_and_logprobs(
        client: openai.OpenAI, model_dir: Path) -> None:
    out = client.chat.completions.create(
        model="policy", messages=CHAT, max_tokens=12, temperature=1.0, seed=7,
        logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The prompt is the chat template's rendering, text parts joined as vLLM does.
    messages = [CHAT[0], {"role": "user", "content": "reverse 123"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    assert out.model_extra["prompt_token_ids"] == list(prompt)
    ids = choice.model_extra["token_ids"]
    assert ids and len(ids) <= 12
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(ids)
    # Token-exact: each reported log-probability is the model's own for that
    # token after exactly these ids (teacher forcing on prompt + ids).
    content = choice.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + ids])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    for pos, (t, c) in enumerate(zip(ids, content, strict=True)):
        assert c.logprob == pytest.approx(logp[pos, t].item(), abs=1e-4)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        best = logp[pos].argmax().item()
        assert tokenizer.decode([best]) in [x.token for x in c.top_logprobs]


def test_seeded_samples_repeat_and_token_ids_can_replace_token_text(
        client: openai.OpenAI) -> None:
    def ask() -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="policy", messages=CHAT, max_completion_tokens=8, n=2, seed=11,
            logprobs=True, extra_body={"return_token_ids": True,
                                       "return_tokens_as_token_ids": True})

    a, b = ask(), ask()
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    for c in a.choices:
        assert [x.token for x in c.logprobs.content] == [
            f"token_id:{t}" for t in c.model_extra["token_ids"]]


def test_bad_chat_requests_get_the_errors_the_openai_client_raises(
        client: openai.OpenAI, model_dir: Path) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs` must be set to true"):
        client.chat.completions.create(model="policy", messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="tools are not supported"):
        client.chat.completions.create(model="policy", messages=CHAT, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="greedy sampling"):
        client.chat.completions.create(model="policy", messages=CHAT, temperature=0, n=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="policy", messages=CHAT, max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT)
    wrong = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="policy", messages=CHAT)


def test_a_prefilled_assistant_turn_continues_in_place(
        client: openai.OpenAI, model_dir: Path) -> None:
    out = client.chat.completions.create(
        model="policy", max_tokens=4, seed=1,
        messages=[*CHAT, {"role": "assistant", "content": "3"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True})
    assert out.choices[0].message.role == "assistant"
    # The rendered prompt ends inside the assistant turn: no end of turn after "3".
    prompt = AutoTokenizer.from_pretrained(model_dir).decode(out.model_extra["prompt_token_ids"])
    assert prompt.endswith("assistant: 3"), prompt


def test_rollout_sends_chat_tasks_to_the_chat_endpoint_and_keeps_the_engines_ids(
        client: openai.OpenAI, model_dir: Path) -> None:
    from rollout.client import CompletionClient

    rollout = CompletionClient(str(client.base_url).removesuffix("/v1/"), KEY, model="policy",
                               retries=0)
    messages = [{"role": "user", "content": "reverse 45"}]
    chat, text = rollout.generate_groups([messages, "reverse 45"], n=2, max_tokens=6, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    assert chat.ok and text.ok and chat.prompt == "reverse 45"
    for sample in chat.samples:
        # The template's tokens as the engine rendered them, not a re-tokenised text.
        assert list(sample.prompt_token_ids) == list(rendered)
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        assert tokenizer.decode(list(sample.token_ids), skip_special_tokens=True) == sample.text
    assert all(list(s.prompt_token_ids) == tokenizer("reverse 45")["input_ids"]
               for s in text.samples)


def test_a_token_exact_conversation_becomes_one_masked_sample(
        client: openai.OpenAI, model_dir: Path) -> None:
    from rollout.client import CompletionClient
    from rollout.conversation import Conversation
    from rollout.episode import Episode, EpisodeError, Turn

    rollout = CompletionClient(str(client.base_url).removesuffix("/v1/"), KEY, model="policy",
                               retries=0)
    conv = Conversation(rollout, [{"role": "user", "content": "reverse 45"}])
    first = conv.generate(max_tokens=5, seed=1)
    conv.add([{"role": "user", "content": "again"}])
    second = conv.generate(max_tokens=5, seed=2)
    # Turn 2 continues turn 1's exact context: prompt + the tokens it sampled.
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(
        first.response_token_ids)] == first.prompt_token_ids + first.response_token_ids
    sample = Episode(tuple(conv.turns), reward=1.0).to_sample("t/0", 0)
    between = len(second.prompt_token_ids) - len(first.prompt_token_ids) - len(
        first.response_token_ids)
    assert between > 0
    assert list(sample.prompt_token_ids) == list(first.prompt_token_ids)
    assert list(sample.response_token_ids) == list(first.response_token_ids) + list(
        second.prompt_token_ids[-between:]) + list(second.response_token_ids)
    assert sample.response_mask == [1] * len(first.response_token_ids) + [0] * between + [
        1] * len(second.response_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(second.prompt_token_ids[-between:]).endswith("assistant: ")
    # A second turn whose prompt does not continue the first's context (an
    # engine re-rendering the conversation) is refused, never trained on.
    other = 3 if first.response_token_ids[:1] != (3,) else 4
    stale = Turn((*first.prompt_token_ids, other), second.response_token_ids,
                 second.response_logprobs)
    at = len(first.prompt_token_ids)
    with pytest.raises(EpisodeError, match=rf"turn 2's prompt does not continue turn 1's "
                       rf"context: they differ at token {at} "):
        Episode((first, stale), reward=0.0).to_sample("t/0", 0)


class OpenAIAgent:
    """Agent code written only against the official openai package."""

    def run(self, task: Any, engine: Any) -> Any:
        from rollout.episode import Episode, Turn

        answer = engine.openai().chat.completions.create(
            model=engine.model, messages=[{"role": "user", "content": task.prompt}],
            max_tokens=6, logprobs=True, extra_body={"return_token_ids": True})
        return Episode((Turn.from_chat(answer),), reward=float(len(answer.choices[0]
                                                                   .message.content or "")))


def test_an_agent_using_only_the_openai_client_runs_unchanged_through_the_runner(
        client: openai.OpenAI) -> None:
    from rollout.agents import EngineEndpoint, EpisodeRunner
    from rollout.client import CompletionClient
    from rollout.tasks import Task

    base = str(client.base_url).removesuffix("/v1/")
    engine = EngineEndpoint(base, KEY, "policy", CompletionClient(base, KEY, model="policy"))
    tasks = [Task(task_id=f"t/{i}", prompt=f"reverse {i}", ground_truth="", data_source="x",
                  split="train") for i in range(2)]
    groups = list(EpisodeRunner(OpenAIAgent(), engine, concurrency=2, timeout_s=60)
                  .iter_groups(tasks, group_size=2))
    for _, samples in groups:
        for s in samples:
            assert not s.failed, s.error
            assert s.prompt_token_ids and s.response_token_ids and s.response_mask is None
            assert s.reward == float(len(s.response_text))


def test_a_text_conversation_continues_with_the_engines_tokens_of_the_added_text(
        client: openai.OpenAI, model_dir: Path) -> None:
    from rollout.client import CompletionClient
    from rollout.conversation import Conversation
    from rollout.episode import Episode

    rollout = CompletionClient(str(client.base_url).removesuffix("/v1/"), KEY, model="policy",
                               retries=0)
    conv = Conversation(rollout, "45>")
    first = conv.generate(max_tokens=4, seed=5)
    conv.add("\nwrong\n45>")
    second = conv.generate(max_tokens=4, seed=6)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    added = tokenizer("\nwrong\n45>", add_special_tokens=False)["input_ids"]
    assert second.prompt_token_ids == first.prompt_token_ids + first.response_token_ids + tuple(
        added)
    sample = Episode(tuple(conv.turns), reward=0.0).to_sample("t", 0)
    assert sample.response_mask == [1] * len(first.response_token_ids) + [0] * len(added) + [
        1] * len(second.response_token_ids)
    with pytest.raises(ValueError, match="takes text, not chat messages"):
        conv.add([{"role": "user", "content": "x"}])
