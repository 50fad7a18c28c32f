"""Randomly initialised models of real architectures (Qwen2, Llama), built offline.

The tiny character model (trainer/tiny_model.py) runs the demo; a researcher's
model is a Hugging Face directory of a real architecture with a BPE tokenizer,
a chat template and bf16 weights.  This module builds such a directory here,
with nothing downloaded, at sizes from under a million parameters to
Qwen2.5-0.5B's shape:

    ArchSpec (arch + shape) ──> config.json               transformers' own config class
                                generation_config.json    bos, eos (end of turn and of
                                                          text), pad; no sampling defaults
                                model.safetensors         random init (seeded), bfloat16
                                tokenizer.json            byte-level BPE trained here
                                tokenizer_config.json     (trainer/bpe.py), special
                                special_tokens_map.json   tokens, the chat template

    arch    chat format                          special tokens (ids 0, 1, ...)
    qwen2   ChatML: <|im_start|>role\\n...<|im_end|>  <|endoftext|> <|im_start|> <|im_end|>
    llama   Llama 3: <|start_header_id|>role         <|begin_of_text|> <|end_of_text|>
            <|end_header_id|>\\n\\n...<|eot_id|>       <|start_header_id|> <|end_header_id|>
                                                     <|eot_id|>

The end-of-turn token is the tokenizer's eos, so a sampled answer ends where
a chat model's does; the model's vocabulary is exactly the tokenizer's, so an
engine never samples an id the tokenizer cannot decode.  Same spec and seed:
the same bytes in every file.
"""

from __future__ import annotations

import enum
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from coordinator.storage.fsio import publish_bytes

WEIGHTS_DTYPE: Final = "bfloat16"  # what models of these architectures ship in


class Arch(str, enum.Enum):
    QWEN2 = "qwen2"
    LLAMA = "llama"


class Size(str, enum.Enum):
    """Named shapes.  tiny and small run the loop on a CPU in the tests; 0.5b is
    Qwen2.5-0.5B's shape (494 M parameters with Qwen2's 151,936-token vocabulary)."""

    TINY = "tiny"
    SMALL = "small"
    HALF_B = "0.5b"


_SHAPES: Final[dict[Size, dict[str, int]]] = {
    # 0.7 M parameters: head_dim 32 (a size every vLLM attention backend takes).
    Size.TINY: dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                    max_position_embeddings=512, tie_word_embeddings=False),
    # 5.2 M parameters.
    Size.SMALL: dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                     max_position_embeddings=1024, tie_word_embeddings=False),
    Size.HALF_B: dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                      max_position_embeddings=32768, tie_word_embeddings=True),
}
# tiny and small keep an lm_head of their own: vLLM's CPU build (0.29) computes a tied
# lm_head from a packed copy made at start (vocab_parallel_embedding.py,
# dispatch_cpu_unquantized_gemm) that its in-place reload leaves stale, which phase 12's
# probe check catches (0.006 and 0.037 against 0.002, measured).  Qwen2.5-0.5B's shape
# keeps them tied (the hf engine reloads it in place; vLLM on a GPU packs no copy, but
# its in-place reload of a tied model is not measured here: the probes would tell).
# Supervised warm-start steps of a built model (trainer/warmstart.py, through its
# chat template), by size: the sampled accuracy on the built-in task's eval prompts
# lands near the character model's 12-20 %, some reward for RL and room to double
# it.  Measured on qwen2 (docs/BENCHMARKS.md, section 10): tiny, 90 steps: 14-19 %
# over seeds 0-2; small, 50 steps: 18-23 % over seeds 0-1 (tied, the same sizes
# gave 3 % at 70 and 18-31 % at 100 steps, 6 % at 45 and 24-37 % at 55).  0.5b:
# none, a CPU would take hours; the demo refuses it.
WARMSTART_STEPS_BY_SIZE: Final = {Size.TINY: 90, Size.SMALL: 50, Size.HALF_B: 0}
# Rotary base: Qwen2.5's and Llama 3's.
_ROPE_THETA: Final = {Arch.QWEN2: 1_000_000.0, Arch.LLAMA: 500_000.0}


@dataclass(frozen=True, kw_only=True)
class ChatFormat:
    """An architecture's special tokens and chat template."""

    special_tokens: tuple[str, ...]
    bos: str | None  # prepended to every encoded text (Llama 3); None: nothing (Qwen2)
    eos: str  # the end of an assistant turn: what generation stops at
    end_of_text: str  # also stops generation; pads
    template: str


CHAT_FORMATS: Final = {
    Arch.QWEN2: ChatFormat(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", end_of_text="<|endoftext|>",
        template=(
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
            " + '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        ),
    ),
    Arch.LLAMA: ChatFormat(
        special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", end_of_text="<|end_of_text|>",
        template=(
            "{{- bos_token }}"
            "{%- for message in messages %}"
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
            " + message['content'] + '<|eot_id|>' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}"
            "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
            "{%- endif %}"
        ),
    ),
}


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """An architecture and its shape; `preset` names the usual ones."""

    arch: Arch
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True  # lm_head is the embedding matrix (Qwen2.5-0.5B)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "arch", Arch(self.arch))
        except ValueError:
            raise ValueError(f"arch={self.arch!r} is not one of "
                             f"{[a.value for a in Arch]}") from None
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} is not a positive integer")
        if self.hidden_size % self.num_attention_heads or self.head_dim % 2:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_attention_heads="
                f"{self.num_attention_heads} is not an even integer head size: pick sizes "
                "whose ratio is e.g. 32, 64 or 128")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: each key/value head serves "
                "a whole group of query heads; give a divisor, e.g. 2")
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range={self.initializer_range} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def chat(self) -> ChatFormat:
        return CHAT_FORMATS[self.arch]

    def parameters(self) -> int:
        """The model's parameter count (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.arch is Arch.QWEN2 else 0)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + h


def preset(arch: Arch | str, size: Size | str, **overrides: Any) -> ArchSpec:
    """The named shape of `size` for `arch`, with `overrides` (None values ignored)."""
    try:
        shape = _SHAPES[Size(size)]
    except ValueError:
        raise ValueError(f"size={size!r} is not one of {[s.value for s in Size]}") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    return ArchSpec(arch=Arch(arch), **{**shape, **given})


def _config(spec: ArchSpec, ids: dict[str, int]) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    shape = {k: v for k, v in asdict(spec).items() if k != "arch"}
    common = dict(
        **shape, hidden_act="silu", rms_norm_eps=1e-6, use_cache=True,
        rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA[spec.arch]},
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        attention_dropout=0.0)
    if spec.arch is Arch.QWEN2:
        config = Qwen2Config(**common, use_sliding_window=False,
                             max_window_layers=spec.num_hidden_layers)
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = LlamaConfig(**common, head_dim=spec.head_dim, attention_bias=False,
                             mlp_bias=False)
        config.architectures = ["LlamaForCausalLM"]
    config.dtype = WEIGHTS_DTYPE
    return config


def _loader_pipeline(arch: Arch) -> dict[str, Any]:
    """The normalizer and pre-tokenizer transformers' tokenizer class for `arch`
    applies on load, whatever tokenizer.json says: training with them keeps
    tokenizer.json and every loader (the trainer, the hf engine, vLLM) in
    agreement.  transformers 5 loads a qwen2 model's tokenizer as Qwen2Tokenizer,
    which rebuilds both from its own definition; a llama model's as written."""
    if arch is not Arch.QWEN2:
        return {}
    from transformers import Qwen2Tokenizer

    backend = Qwen2Tokenizer().backend_tokenizer
    return {"normalizer": backend.normalizer, "pre_tokenizer": backend.pre_tokenizer}


def _special_ids(tokenizer: Any, chat: ChatFormat) -> dict[str, int]:
    def id_of(token: str) -> int:
        found = tokenizer.token_to_id(token)
        assert found is not None, token  # the trainer adds every special token
        return int(found)

    return {"bos": id_of(chat.bos or chat.end_of_text), "eos": id_of(chat.eos),
            "end_of_text": id_of(chat.end_of_text), "pad": id_of(chat.end_of_text)}


def _tokenizer_files(raw: Any, spec: ArchSpec) -> dict[str, bytes]:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    chat = spec.chat
    if chat.bos is not None:
        bos_id = raw.token_to_id(chat.bos)
        raw.post_processor = processors.TemplateProcessing(
            single=f"{chat.bos} $A", pair=f"{chat.bos} $A $B", special_tokens=[(chat.bos, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=chat.bos, eos_token=chat.eos,
        pad_token=chat.end_of_text, model_max_length=spec.max_position_embeddings,
        chat_template=chat.template, clean_up_tokenization_spaces=False)
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    # The class named explicitly, so AutoTokenizer loads tokenizer.json as it is
    # (a Qwen2Tokenizer class would rebuild its own pre-tokenizer); the template in
    # tokenizer_config.json, which every transformers version reads.
    config = json.loads(files["tokenizer_config.json"])
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat.template
    files["tokenizer_config.json"] = _json(config)
    files.pop("chat_template.jinja", None)
    files["special_tokens_map.json"] = _json(
        {k: v for k, v in (("bos_token", chat.bos), ("eos_token", chat.eos),
                           ("pad_token", chat.end_of_text)) if v is not None})
    return files


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _weight_files(spec: ArchSpec, config: Any, seed: int) -> dict[str, bytes]:
    import torch
    from transformers import AutoModelForCausalLM

    # fork_rng: seeding must not disturb the caller's global RNG stream.  The
    # initialisation runs in float32 (transformers' init functions), then rounds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, WEIGHTS_DTYPE))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir()
                if p.is_file() and p.name.endswith((".safetensors", ".json"))
                and p.name != "generation_config.json"}


def create_model(out_dir: Path, spec: ArchSpec, *, seed: int = 0) -> Path:
    """Write a random model of `spec` with its trained tokenizer into `out_dir`.

    Same spec and seed -> the same bytes.  Existing files of the same names are
    replaced atomically.  Returns `out_dir`.
    """
    from trainer.bpe import train_bpe

    if seed < 0:
        raise ValueError(f"seed={seed} is negative: give a seed >= 0")
    out_dir = Path(out_dir)
    out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    raw = train_bpe(spec.vocab_size, spec.chat.special_tokens, **_loader_pipeline(spec.arch))
    ids = _special_ids(raw, spec.chat)
    config = _config(spec, ids)
    files = _tokenizer_files(raw, spec)
    files.update(_weight_files(spec, config, seed))
    files["generation_config.json"] = _json({
        "bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["end_of_text"]],
        "pad_token_id": ids["pad"]})
    for name, data in sorted(files.items()):
        publish_bytes(out_dir / name, data)
    return out_dir
