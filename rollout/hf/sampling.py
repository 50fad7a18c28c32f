"""Sampling for rollout.hf.server: the model, its weights' lifecycle and the generation loop.

Responses mirror vLLM's CompletionResponse so one client parses both: each
choice has text, index (prompt i, sample j -> i*n + j), finish_reason
("stop" on EOS or a stop string, "length" at max_tokens), stop_reason,
logprobs {tokens, token_logprobs, top_logprobs, text_offset} and, with
`return_token_ids`, prompt_token_ids and token_ids.  As in vLLM, token_ids
include the EOS token and the token that completed a stop string; the text
excludes both.  With `echo` the prompt comes first in the text and, with
`logprobs`, in the log-probabilities (its first token's is null); `echo` with
`max_tokens: 0` scores a sequence without generating (vLLM generates one
token and discards it; this server generates none, so token_ids is empty).

Log-probabilities are log_softmax of the model's raw logits (before
temperature and top-p), i.e. the policy's log-prob of each sampled token;
vLLM's default logprobs mode ("raw_logprobs") reports the same quantity.

Sampling is a short loop over the model's forward pass with a KV cache rather
than `generate()`: `generate` draws from torch's global RNG, which concurrent
requests would share, while here each request owns a torch.Generator, so a
request with a seed always gets the same samples (as in vLLM).  Requests are
served one at a time (a lock); each is batched over its prompts x n rows.

torch and transformers are imported inside Generator, not here: the HTTP
layer imports this module before it binds its port, and a warm spare must
bind at once and import the slow runtime afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rollout.hf.request import DTYPES, BadRequest, CompletionRequest
from rollout.hf.weights import ResidentModel

T = TypeVar("T")


class Asleep(RuntimeError):
    """A completion arrived while the weights sleep; the server answers 503."""


@dataclass
class _Row:
    """One row of a batch being sampled: what it generated and why it ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None
    text: str | None = None  # cut at a stop string; None: decode the tokens

    def result(self, decode: Any) -> dict[str, Any]:
        return {
            "token_ids": self.tokens,
            "token_logprobs": self.logprobs,
            "top": self.top,
            "finish_reason": self.finish or "length",
            "stop_reason": self.stop_reason,
            "text": self.text if self.text is not None else decode(self.tokens),
        }


def _concat_blocks(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two logprobs blocks as one: the echoed prompt's, then the completion's."""
    shift = sum(len(t) for t in first["tokens"])
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]],
    }


class Generator:
    """The model, its tokenizer and the sampling loop.  Loaded once at startup."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str,
        dtype: str,
        max_batch: int,
        seed: int,
        max_model_len: int | None,
    ) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        torch_dtype = getattr(torch, DTYPES[dtype])
        # transformers renamed torch_dtype to dtype in 4.56.
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, use_safetensors=True, **{dtype_kw: torch_dtype}
        )
        self.resident = ResidentModel(
            model.to(self.device).eval(),  # type: ignore[arg-type]  # transformers' stub
            device=self.device, torch=torch)
        self.model_dir = Path(model_dir)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        limit = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(max_model_len or limit, limit)
        eos: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), cfg):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            eos.update([e] if isinstance(e, int) else list(e or []))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(eos) if eos else 0)
        self._rng = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self._running = threading.Event()  # cleared while paused (POST /pause)
        self._running.set()

    @property
    def model(self) -> Any:
        return self.resident.model

    # The weights' lifecycle (vLLM's sleep mode), serialised with completions.
    def sleep(self, level: int) -> None:
        with self.lock:
            self.resident.sleep(level)

    def wake_up(self, tags: list[str] | None) -> None:
        with self.lock:
            self.resident.wake_up(tags)

    def is_sleeping(self) -> bool:
        with self.lock:
            return self.resident.sleeping

    def pause(self) -> None:
        """New completions wait; returns once the one in progress is done."""
        self._running.clear()
        with self.lock:
            pass

    def resume(self) -> None:
        self._running.set()

    def is_paused(self) -> bool:
        return not self._running.is_set()

    def reload_weights(self, weights_path: Path | None) -> None:
        """vLLM's reload_weights: the new directory, or the served one again."""
        with self.lock:
            self.resident.reload(weights_path or self.model_dir)
            if weights_path is not None:
                self.model_dir = Path(weights_path)

    def piece(self, token_id: int) -> str:
        """One token as text on its own (special tokens kept), as vLLM's logprobs show it."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def locked(self, work: Callable[[Generator], T]) -> T:
        """Run `work` with the model and tokenizer to itself: one request at a time,
        tokenizer included (a fast tokenizer used from two threads can fail with
        "Already borrowed"), never while the weights sleep, and not while paused (it
        waits for the resume)."""
        while True:
            self._running.wait()
            with self.lock:
                if not self._running.is_set():
                    continue  # paused while this request waited for the lock
                if self.resident.sleeping:
                    raise Asleep("the engine is asleep (POST /sleep): wake it with POST "
                                 "/wake_up before sending completions")
                return work(self)

    def complete(self, req: CompletionRequest) -> list[dict[str, Any]]:
        return self.locked(lambda g: g._complete(req))

    def check_prompt(self, ids: list[int], max_tokens: int, what: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise BadRequest(f"token id {max(ids)} is outside this model's vocabulary "
                             f"0..{self.vocab_size - 1}")
        if len(ids) + max_tokens > self.max_model_len:
            raise BadRequest(
                f"prompt of {len(ids)} tokens + max_tokens={max_tokens} exceeds this "
                f"model's maximum context length of {self.max_model_len}: shorten the "
                f"prompt {what[:40]!r} or lower max_tokens"
            )

    def _prompt_ids(self, req: CompletionRequest) -> list[list[int]]:
        prompt_ids = []
        for p in req.prompts:
            ids = list(p) if isinstance(p, tuple) else list(self.tokenizer(p)["input_ids"])
            self.check_prompt(ids, req.max_tokens, str(p))
            prompt_ids.append(ids)
        return prompt_ids

    def generate(self, prompt_ids: list[list[int]], req: CompletionRequest,
                 ) -> list[dict[str, Any]]:
        """`req.n` samples of each prompt, in order (prompt i, sample j at i*n + j): token
        ids, their log-probabilities, the top-k at each step, finish and stop reasons."""
        rows = [(i, j) for i in range(len(prompt_ids)) for j in range(req.n)]
        seed = (
            req.seed
            if req.seed is not None
            else int(self.torch.randint(0, 2**62, (1,), generator=self._rng))
        )
        gen = self.torch.Generator().manual_seed(seed)
        outputs: list[dict[str, Any]] = []
        for start in range(0, len(rows), self.max_batch):
            chunk = rows[start : start + self.max_batch]
            if req.max_tokens == 0:  # echo only: nothing is generated
                outputs += [_Row(finish="length").result(self._decode) for _ in chunk]
            else:
                outputs += self._sample([prompt_ids[i] for i, _ in chunk], req, gen)
        return outputs

    def _complete(self, req: CompletionRequest) -> list[dict[str, Any]]:
        prompt_ids = self._prompt_ids(req)
        rows = [(i, j) for i in range(len(req.prompts)) for j in range(req.n)]
        outputs = self.generate(prompt_ids, req)
        echoed = self._echo(prompt_ids, req) if req.echo else None
        choices = []
        for index, ((i, _), out) in enumerate(zip(rows, outputs, strict=True)):
            choice = {
                "index": index,
                "text": out["text"],
                "finish_reason": out["finish_reason"],
                "stop_reason": out["stop_reason"],
                "logprobs": None,
            }
            if req.logprobs is not None:
                choice["logprobs"] = self._logprobs_block(out, req.logprobs)
            if echoed is not None:
                # vLLM's echo: the prompt comes first, in the text and in the logprobs.
                text, block = echoed[i]
                choice["text"] = text + out["text"]
                if block is not None and choice["logprobs"] is not None:
                    choice["logprobs"] = _concat_blocks(block, choice["logprobs"])
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(prompt_ids[i])
                choice["token_ids"] = out["token_ids"]
            choices.append(choice)
        return choices

    def _logprobs_block(self, out: dict[str, Any], k: int) -> dict[str, Any]:
        tokens = [self.piece(t) for t in out["token_ids"]]
        offsets, pos = [], 0
        for piece in tokens:
            offsets.append(pos)
            pos += len(piece)
        top: list[dict[str, float] | None] = []
        for t, lp, ranked in zip(
            out["token_ids"], out["token_logprobs"], out["top"], strict=True
        ):
            if lp is None:  # the first prompt token has no log-probability
                top.append(None)
                continue
            ids, lps = ranked
            entry = {self.piece(a): b for a, b in zip(ids[:k], lps[:k], strict=True)}
            entry[self.piece(t)] = lp  # vLLM always includes the sampled token
            top.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": out["token_logprobs"],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _echo(self, prompts: list[list[int]], req: CompletionRequest
              ) -> list[tuple[str, dict[str, Any] | None]]:
        """Each prompt's text and, with `logprobs`, its tokens' log-probabilities.

        As vLLM's prompt logprobs: position 0 has none (null); position t is
        log_softmax of the logits after tokens 0..t-1, at token t.
        """
        scored: list[tuple[list[float | None], list[Any]]] = []
        if req.logprobs is not None:
            for start in range(0, len(prompts), self.max_batch):
                scored += self._score(prompts[start : start + self.max_batch], req.logprobs)
        echoed = []
        for r, ids in enumerate(prompts):
            block = None
            if scored:
                lps, top = scored[r]
                out = {"token_ids": ids, "token_logprobs": lps, "top": top}
                block = self._logprobs_block(out, req.logprobs or 0)
            echoed.append((self._decode(ids), block))
        return echoed

    def _score(self, prompts: list[list[int]], k: int
               ) -> list[tuple[list[float | None], list[Any]]]:
        torch = self.torch
        ids, mask, positions = self._left_pad(prompts)
        width = ids.shape[1]
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=positions.to(self.device)).logits.float().cpu()
        logp = torch.log_softmax(logits[:, :-1, :], dim=-1)
        chosen = logp.gather(2, ids[:, 1:, None])[:, :, 0]
        top_v, top_i = logp.topk(k, dim=-1)
        scored = []
        for r, p in enumerate(prompts):
            first = width - len(p)  # left padding: the prompt's tokens end the row
            span = range(first, width - 1)
            lps: list[float | None] = [None] + [float(chosen[r, c]) for c in span]
            top: list[Any] = [None] + [(top_i[r, c].tolist(), top_v[r, c].tolist())
                                       for c in span]
            scored.append((lps, top))
        return scored

    def _sample(
        self, prompts: list[list[int]], req: CompletionRequest, gen: Any
    ) -> list[dict[str, Any]]:
        """Decode `req.max_tokens` steps for every row at once, with the KV cache."""
        torch = self.torch
        ids, mask, positions = self._left_pad(prompts)
        k = req.logprobs or 0
        rows = [_Row() for _ in prompts]
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
            )
            for step in range(req.max_tokens):
                logits = out.logits[:, -1, :].float().cpu()
                logp = torch.log_softmax(logits, dim=-1)
                nxt = self._pick(logits, req, gen)
                chosen = logp.gather(1, nxt[:, None])[:, 0]
                # k = 0 still returns (empty) tensors: one code path for both.
                top_v, top_i = logp.topk(k, dim=-1)
                for r, row in enumerate(rows):
                    if row.finish is None:
                        self._extend(row, int(nxt[r]), float(chosen[r]),
                                     (top_i[r].tolist(), top_v[r].tolist()), req)
                if all(row.finish is not None for row in rows) or step + 1 == req.max_tokens:
                    break
                feed = torch.tensor(
                    [[row.tokens[-1] if row.finish is None else self.pad_id] for row in rows],
                    dtype=torch.long,
                )
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(
                    input_ids=feed.to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=positions.to(self.device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return [row.result(self._decode) for row in rows]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Any, Any, Any]:
        """ids, attention mask and positions; left padding puts every row's next token
        in the last column."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _extend(self, row: _Row, token: int, logprob: float,
                top: tuple[list[int], list[float]], req: CompletionRequest) -> None:
        """One sampled token into a row; a row ends on EOS or a stop string."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.top.append(top)
        if token in self.eos_ids:
            row.finish = "stop"
        elif req.stop:
            text = self._decode(row.tokens)
            hits = [(text.find(s), s) for s in req.stop if s in text]
            if hits:
                at, s = min(hits)
                row.finish, row.stop_reason, row.text = "stop", s, text[:at]

    def _pick(self, logits: Any, req: CompletionRequest, gen: Any) -> Any:
        torch = self.torch
        if req.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / req.temperature, dim=-1)
        if req.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
            drop = (sorted_p.cumsum(-1) - sorted_p) >= req.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]
