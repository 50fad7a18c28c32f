"""POST /v1/chat/completions on the hf server, as vLLM 0.29.0 answers it (non-streaming).

The conversation goes through the model's own chat template (the
tokenizer's `apply_chat_template`, as vLLM renders it), the rendered token
ids are sampled like a completion, and the answer has vLLM's shape field for
field, so agent code written against the OpenAI chat API runs unchanged:

    request   messages (content a string or a list of {"type": "text"} parts),
              max_completion_tokens | max_tokens (default: the rest of the
              context), temperature, top_p, n, seed, stop (<= 4 strings),
              logprobs + top_logprobs (<= 20), return_token_ids,
              return_tokens_as_token_ids, add_generation_prompt,
              continue_final_message, chat_template_kwargs; unknown fields are
              ignored (vLLM's models allow extra fields); tools are refused
              (no tool parser here: the model's text is the answer)
    answer    choices[i].message.content, .logprobs.content[] ({token,
              logprob, bytes, top_logprobs: the sampled token first, then the
              ranks}), .token_ids (the generated ids, EOS included) and the
              top-level prompt_token_ids (the rendered prompt) with
              return_token_ids: the exact tokens a trainer needs, no
              re-tokenisation

vLLM added return_token_ids on both endpoints in 0.10.2.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Final

from rollout.hf.request import MAX_TOP_LOGPROBS, BadRequest, CompletionRequest
from rollout.hf.sampling import Generator

MAX_STOP_STRINGS: Final = 4  # vLLM's VLLM_MAX_STOP_STRINGS
MIN_LOGPROB: Final = -9999.0  # vLLM clamps log-probabilities here


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "\n".join(p["text"] for p in content)  # vLLM's "string" content format
    raise BadRequest(f"messages[{index}].content must be a string, null or a list of "
                     '{"type": "text", "text": ...} parts (this server reads text only)')


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role")
        out.append({"role": m["role"], "content": _text(m.get("content"), i)})
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    messages: tuple[dict[str, str], ...]
    max_tokens: int | None
    sampling: CompletionRequest  # n, temperature, top_p, seed, stop, top-k logprobs
    logprobs: bool
    return_token_ids: bool
    token_ids_as_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]

    @classmethod
    def from_json(cls, body: Any) -> ChatRequest:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported: send stream=false")
        if body.get("tools"):
            raise BadRequest("tools are not supported by the hf engine (it has no tool-call "
                             "parser): describe the tools in the messages and parse the answer")
        messages = _messages(body.get("messages"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise BadRequest(f"max_tokens must be at least 1, got {limit}.")
        logprobs = bool(body.get("logprobs") or False)
        top = body.get("top_logprobs")
        top = 0 if top is None else top
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise BadRequest("`top_logprobs` must be a positive value or 0.")
        if top > 0 and not logprobs:
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.")
        if top > MAX_TOP_LOGPROBS:
            raise BadRequest(f"Requested sample logprobs of {top}, which is greater than max "
                             f"allowed: {MAX_TOP_LOGPROBS}")
        stop = body.get("stop") or []
        if len([stop] if isinstance(stop, str) else stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings")
        if body.get("add_generation_prompt") is True and body.get("continue_final_message"):
            raise BadRequest("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        continue_final = bool(body.get("continue_final_message") or False)
        # The sampling fields, validated as a completion's (prompt filled in later).
        sampling = CompletionRequest.from_json({
            "prompt": [0], "n": body.get("n"), "max_tokens": limit or 1,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "seed": body.get("seed"), "stop": stop, "logprobs": top if logprobs else None})
        if sampling.temperature < 1e-5 and sampling.n > 1:
            raise BadRequest(f"n must be 1 when using greedy sampling, got {sampling.n}.")
        return cls(messages=messages, max_tokens=limit, sampling=sampling, logprobs=logprobs,
                   return_token_ids=bool(body.get("return_token_ids") or False),
                   token_ids_as_tokens=bool(body.get("return_tokens_as_token_ids") or False),
                   add_generation_prompt=bool(body.get("add_generation_prompt", True))
                   and not continue_final,
                   continue_final_message=continue_final, template_kwargs=dict(kwargs))

    def render(self, tokenizer: Any) -> list[int]:
        """The conversation as the model's chat template makes it, in token ids."""
        try:
            ids = tokenizer.apply_chat_template(
                list(self.messages), tokenize=True,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message, **self.template_kwargs)
        except Exception as exc:  # a template error is the request's fault, not the server's
            raise BadRequest(f"the chat template could not render these messages: "
                             f"{type(exc).__name__}: {exc}") from exc
        if hasattr(ids, "keys"):  # a BatchEncoding (newer transformers return one)
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def answer(self, g: Generator, model_name: str) -> dict[str, Any]:
        """Render, sample and shape the answer; call under Generator.locked."""
        prompt = self.render(g.tokenizer)
        max_tokens = self.max_tokens or max(1, g.max_model_len - len(prompt))
        g.check_prompt(prompt, max_tokens, self.messages[-1]["content"])
        sampling = CompletionRequest(
            prompts=(tuple(prompt),), n=self.sampling.n, max_tokens=max_tokens,
            temperature=self.sampling.temperature, top_p=self.sampling.top_p,
            seed=self.sampling.seed, logprobs=self.sampling.logprobs, stop=self.sampling.stop)
        outputs = g.generate([prompt], sampling)
        role = "assistant" if self.add_generation_prompt else self.messages[-1]["role"]
        choices = [self._choice(g, i, out, role) for i, out in enumerate(outputs)]
        completion = sum(len(out["token_ids"]) for out in outputs)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
            "created": int(time.time()), "model": model_name, "choices": choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None,
                      "completion_tokens_details": None},
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if self.return_token_ids else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None,
        }

    def _choice(self, g: Generator, index: int, out: dict[str, Any], role: str,
                ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": role, "content": out["text"], "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "reasoning": None},
            "logprobs": self._logprobs(g, out) if self.logprobs else None,
            "finish_reason": out["finish_reason"] or "stop",
            "stop_reason": out["stop_reason"],
            "token_ids": list(out["token_ids"]) if self.return_token_ids else None,
            "routed_experts": None,
        }

    def _token(self, g: Generator, token_id: int) -> str:
        return f"token_id:{token_id}" if self.token_ids_as_tokens else g.piece(token_id)

    def _logprobs(self, g: Generator, out: dict[str, Any]) -> dict[str, Any]:
        k = self.sampling.logprobs or 0
        content = []
        for t, lp, (ids, lps) in zip(out["token_ids"], out["token_logprobs"], out["top"],
                                     strict=True):
            # vLLM lists the sampled token first, then the ranks, without repeats.
            ranked = [(t, lp)] + [(a, b) for a, b in zip(ids, lps, strict=True) if a != t]
            top = []
            for a, b in ranked[:k]:
                token = self._token(g, a)
                top.append({"token": token, "logprob": max(b, MIN_LOGPROB),
                            "bytes": list(token.encode())})
            text = g.piece(t)
            content.append({"token": self._token(g, t), "logprob": max(lp, MIN_LOGPROB),
                            "bytes": list(text.encode()) if text else None,
                            "top_logprobs": top})
        return {"content": content}


def tokenize_answer(g: Generator, body: Any) -> dict[str, Any]:
    """POST /tokenize as vLLM answers it: chat messages through the template (with
    add_generation_prompt, default true), or a text prompt; call under Generator.locked."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "messages" in body:
        req = ChatRequest.from_json({**body, "stream": False, "tools": None})
        tokens = req.render(g.tokenizer)
    elif isinstance(body.get("prompt"), str):
        special = body.get("add_special_tokens", True)
        tokens = list(g.tokenizer(body["prompt"], add_special_tokens=bool(special))["input_ids"])
    else:
        raise BadRequest("give messages (a chat) or prompt (a string) to tokenize")
    return {"count": len(tokens), "max_model_len": g.max_model_len, "tokens": tokens,
            "token_strs": None}
