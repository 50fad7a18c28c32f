"""A tiny, randomly initialised causal LM in Hugging Face format, built offline.

The whole loop (rollout server, trainer, vLLM on a GPU box) must run on a fresh
machine with no model download, so tests and the demo build their own model:
a two-layer Llama with a character-level tokenizer.  Llama is chosen because
every engine knows it (transformers' `LlamaForCausalLM`, vLLM's native Llama
implementation), and a character vocabulary makes the digit-reversal task one
token per digit.

Files written (all atomically, mode 0o644):

    config.json              Llama config, readable by transformers 4.x and 5.x
    generation_config.json   bos/eos/pad ids only (no sampling defaults, so
                             servers keep the sampling parameters they are sent)
    model.safetensors        float32 weights; same seed -> same bytes
    tokenizer.json           WordLevel over single characters
    tokenizer_config.json    PreTrainedTokenizerFast + chat template
    special_tokens_map.json
"""

from __future__ import annotations

import json
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from coordinator.storage.fsio import publish_bytes

PAD_TOKEN: Final = "<pad>"
BOS_TOKEN: Final = "<bos>"
EOS_TOKEN: Final = "<eos>"
UNK_TOKEN: Final = "<unk>"
SPECIAL_TOKENS: Final = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
UNK_ID: Final = 3

# Ids are positions in this tuple.  Uppercase letters and newline are included
# beyond the digits/lowercase/punctuation the task needs, so that chat
# templates and ordinary English text do not collapse to <unk>.
TINY_VOCAB: Final[tuple[str, ...]] = (
    *SPECIAL_TOKENS,
    *string.digits,
    *string.ascii_lowercase,
    *string.ascii_uppercase,
    " ",
    "\n",
    *string.punctuation,
)

# Kept to characters in TINY_VOCAB so a rendered conversation never hits <unk>.
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

WEIGHTS_FILE: Final = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of the tiny model.

    head_dim = hidden_size / num_attention_heads must be a size vLLM's GPU
    attention kernels support (32, 64, 128, ...), hence 128/4 = 32 by default.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 128
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} is below 1: give a positive size")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}: pick sizes whose "
                "ratio is an integer head dimension, e.g. 128 and 4"
            )
        if self.initializer_range <= 0:
            raise ValueError(f"initializer_range={self.initializer_range} must be > 0, e.g. 0.02")


def llama_config_dict(spec: TinyModelSpec) -> dict[str, Any]:
    """config.json contents, written by hand rather than by LlamaConfig.

    transformers 5 writes `dtype` and `rope_parameters`, 4.x (which vLLM may
    pin) reads `torch_dtype` and `rope_theta`; both spellings are given so
    either version loads the same model.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(TINY_VOCAB),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def build_tokenizer_object() -> Any:
    """The raw `tokenizers.Tokenizer`: one token per character, <bos> prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character is its own pre-token (spaces and newlines included), so
    # WordLevel maps characters to ids one to one.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates without the space WordLevel would otherwise insert.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def _tokenizer_files(spec: TinyModelSpec) -> dict[str, bytes]:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer_object(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=spec.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    # Name the class explicitly: AutoTokenizer in both transformers 4.x and 5.x
    # then builds a fast tokenizer straight from tokenizer.json.
    cfg = json.loads(files["tokenizer_config.json"])
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    files["tokenizer_config.json"] = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    # Some transformers versions store the template in its own file; the copy
    # in tokenizer_config.json is enough for all of them.
    files.pop("chat_template.jinja", None)
    files["special_tokens_map.json"] = (
        json.dumps(
            {
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "unk_token": UNK_TOKEN,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    ).encode()
    return files


def _weights_bytes(spec: TinyModelSpec, seed: int) -> bytes:
    import torch
    from safetensors.torch import save
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{
            k: v
            for k, v in llama_config_dict(spec).items()
            if k not in ("torch_dtype", "rope_scaling", "rope_theta", "model_type")
        }
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    state = {
        k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()
    }
    # "format": "pt" is the metadata transformers checks before loading.
    return save(state, metadata={"format": "pt"})


def create_tiny_model(out_dir: Path, *, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny random Llama with a character tokenizer into `out_dir`.

    Same seed and spec -> byte-identical model.safetensors.  Existing files of
    the same names are replaced atomically.  Returns `out_dir`.
    """
    if seed < 0:
        raise ValueError(f"seed={seed} is negative: give a seed >= 0")
    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(mode=0o755, parents=True, exist_ok=True)

    def dump(obj: Any) -> bytes:
        return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

    files = _tokenizer_files(spec)
    files["config.json"] = dump(llama_config_dict(spec))
    files["generation_config.json"] = dump(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    )
    files[WEIGHTS_FILE] = _weights_bytes(spec, seed)
    for name, data in sorted(files.items()):
        publish_bytes(out_dir / name, data)
    return out_dir
