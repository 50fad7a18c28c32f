"""Loading a model for FSDP2 without any rank ever holding all of it.

    config.json --> the model built with its parameters on the meta device
                    (no memory, no init: transformers' no_init_weights); buffers
                    such as rotary frequencies are built for real (they are small)
    --> fully_shard per decoder layer and the root (distributed.wrap_model)
    --> to_empty: each rank allocates only its own shard of every parameter
    --> for each parameter, only the rows of this rank's shard, read from the
        safetensors file with pread (the header's offsets), cast into the local shard

FSDP2 shards every parameter on dim 0 like torch.chunk: rank r holds rows
[r * ceil(n / W), ...) of an n-row parameter over W ranks.  A tied parameter
(lm_head sharing the embedding) is one parameter under its first name; a name
the files do not hold must be one of the model's tied keys, or loading fails
naming it.  The weights are the checkpoint's, verified against its manifest
first, exactly as the unsharded path reads them (policy.load_model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout.shard_index import shard_file
from trainer.distributed import DistContext, wrap_model
from trainer.errors import TrainError

log = logging.getLogger("trainer")

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers
    stay real.  Parameter init is skipped (no_init_weights): nothing is allocated
    for a parameter but the moment before it moves to meta."""
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        mapping = json.loads(index.read_text()).get("weight_map", {})
        if not isinstance(mapping, dict):
            raise TrainError(f"{index} has no weight_map object")
        try:
            return {str(name): model_dir / shard_file(index, file)
                    for name, file in mapping.items()}
        except ValueError as exc:
            raise TrainError(str(exc)) from None
    single = model_dir / SAFETENSORS_SINGLE
    if not single.is_file():
        raise TrainError(f"{model_dir} has neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}:"
                         " sharded loading reads safetensors files")
    return {name: single for name in read_header(single)}


def _tied_sources(model: Any) -> dict[str, str]:
    """A tied parameter's name -> the name its weights are stored under."""
    tied = getattr(model, "_tied_weights_keys", None)
    out = dict(tied) if isinstance(tied, dict) else {}
    if getattr(model.config, "tie_word_embeddings", False):
        out.setdefault("lm_head.weight", "model.embed_tokens.weight")
    return out


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of this rank's dim-0 shard, as FSDP2 (torch.chunk) cuts it."""
    size = math.ceil(rows / world) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def load_sharded_model(model_dir: Path, ctx: DistContext, *, trainable: bool,
                       dtype: torch.dtype = torch.float32,
                       prepare: Callable[[Any], None] | None = None) -> Any:
    """The model of `model_dir`, wrapped with FSDP2, each rank holding only its shards;
    `prepare` runs on the bare model before wrapping (activation checkpointing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Built on meta, a tied lm_head is a parameter of its own (the embedding's was
    # replaced by its meta twin after the tie): tied again, it is one parameter,
    # sharded, loaded and trained once, as in the model from_pretrained builds.
    model.tie_weights()
    model.config.use_cache = False
    if not trainable:
        model.requires_grad_(False)
    if prepare is not None:
        prepare(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    wrapped = wrap_model(model, ctx, trainable=trainable)
    wrapped.to_empty(device=ctx.device)
    with torch.no_grad():
        for name, buffer in wrapped.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
        _fill(wrapped, model_dir, ctx)
    log.info("rank %d: loaded its shards of %s (%s)", ctx.rank, model_dir, dtype)
    return wrapped


def _fill(model: Any, model_dir: Path, ctx: DistContext) -> None:
    files = weight_files(model_dir)
    tied = _tied_sources(model)
    with contextlib.ExitStack() as stack:
        opened: dict[Path, tuple[int, dict[str, TensorSpan]]] = {}  # one descriptor a file
        for name, param in model.named_parameters():
            source = name if name in files else tied.get(name)
            if source is None or source not in files:
                raise TrainError(f"parameter {name} is in no safetensors file of {model_dir}: "
                                 "the checkpoint does not match its config.json")
            path = files[source]
            if path not in opened:
                opened[path] = (stack.enter_context(open(path, "rb")).fileno(),
                                read_header(path))
            fd, table = opened[path]
            span = table.get(source)
            if span is None:
                raise TrainError(f"{path} does not hold {source}, as its index says it does")
            if span.shape != tuple(param.shape):
                raise TrainError(f"{source} in {path} has shape {span.shape}, the model "
                                 f"expects {tuple(param.shape)}")
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.ndim == 0 or local.shape == param.shape:
                start, end = 0, span.shape[0] if span.shape else 1
            else:
                start, end = shard_rows(span.shape[0], ctx.world_size, ctx.rank)
                if end - start != local.shape[0]:
                    raise TrainError(f"{name}: rank {ctx.rank} holds {local.shape[0]} rows, "
                                     f"the dim-0 split of {span.shape[0]} over "
                                     f"{ctx.world_size} gives {end - start}")
            if end > start:
                local.copy_(span.read_rows(fd, path, start, end))


# -- reading rows of a safetensors file ------------------------------------------
# The format: 8 bytes (little-endian header length), a JSON header naming each
# tensor's dtype, shape and [begin, end) byte offsets in the data that follows.
# Rows are read with pread: only this rank's bytes ever enter its memory (a
# memory map would count every page it touched, the whole file at worst).

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 2**20


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int

    def read_rows(self, fd: int, path: Path, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) along dim 0 (a 0-d tensor: its one value), read from the
        open file `fd` (`path` names it in errors)."""
        rows = self.shape[0] if self.shape else 1
        row_bytes = (self.end - self.begin) // max(rows, 1)
        buffer = bytearray((end - start) * row_bytes)
        got = os.preadv(fd, [buffer], self.begin + start * row_bytes)
        if got != len(buffer):
            raise TrainError(f"{path}: short read of {got} of {len(buffer)} bytes: truncated?")
        flat = torch.frombuffer(buffer, dtype=self.dtype) if buffer else \
            torch.empty(0, dtype=self.dtype)
        return flat.reshape((end - start, *self.shape[1:]) if self.shape else ())


def read_header(path: Path) -> dict[str, TensorSpan]:
    """Every tensor's span in a safetensors file, each checked against the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TrainError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        length = int.from_bytes(raw, "little")
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise TrainError(f"{path}: header length {length} is impossible for a {size}-byte "
                             "file")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise TrainError(f"{path}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise TrainError(f"{path}: the header is not a JSON object")
    base = 8 + length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TrainError(f"{path}: tensor {name!r} has a malformed entry ({exc})") from exc
        count = math.prod(shape)
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= size - base or \
                end - begin != count * torch.tensor([], dtype=dtype).element_size():
            raise TrainError(f"{path}: tensor {name!r} (shape {shape}, {entry['dtype']}) does "
                             f"not fit its bytes [{begin}, {end})")
        out[name] = TensorSpan(dtype=dtype, shape=shape, begin=base + begin, end=base + end)
    return out
