"""The hf server's model in memory: loaded, put to sleep, woken, reloaded in place.

The same lifecycle vLLM's sleep mode gives `vllm serve` (docs: sleep mode;
vLLM 0.29 `EngineCore.sleep`/`wake_up`, `GPUModelRunner.reload_weights`), so
the CPU engine stands in for it request for request:

    loaded ──sleep(1)──► asleep, weights copied to host memory ──wake_up──► the old weights
           ──sleep(2)──► asleep, weights dropped ──wake_up──► garbage weights until
                                                           reload_weights(dir)
    reload_weights(dir): the new checkpoint's tensors copied into the running model

Asleep, the parameters live on the meta device: their memory is released.
Buffers (rotary inverse frequencies) are not weights: like vLLM at level 2,
they are kept on the host and restored on waking.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rollout.shard_index import shard_file

log = logging.getLogger("rollout.hf.server")


class WeightsError(RuntimeError):
    """A reload could not read the checkpoint or it does not fit the model."""


class ResidentModel:
    """The model and its sleep state; the caller serialises access (one lock)."""

    def __init__(self, model: Any, *, device: Any, torch: Any) -> None:
        self.model = model
        self.device = device
        self.torch = torch
        self.sleep_level: int | None = None  # None: awake
        self._host_weights: dict[str, Any] | None = None
        self._buffers: dict[str, Any] = {}

    @property
    def sleeping(self) -> bool:
        return self.sleep_level is not None

    def sleep(self, level: int) -> None:
        """Release the weights' memory; level 1 keeps a host copy, level 2 does not."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not 1 or 2")
        if self.sleeping:
            return  # as vLLM: sleeping again is a no-op
        self._buffers = {k: v.detach().to("cpu", copy=True)
                         for k, v in self.model.named_buffers()}
        self._host_weights = {k: v.detach().to("cpu", copy=True)
                              for k, v in self.model.state_dict().items()} if level == 1 else None
        self.model.to("meta")
        self.sleep_level = level
        log.info("asleep at level %d: weights released%s", level,
                 " (a host copy kept)" if level == 1 else "")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Give the weights memory again; level 2 leaves it uninitialised until a reload.

        `tags` as vLLM's: "weights", "kv_cache"; the hf server has no KV cache
        between requests, so only "weights" (or no tags: everything) does work.
        """
        if not self.sleeping or (tags is not None and "weights" not in tags):
            return
        self.model.to_empty(device=self.device)
        # To the meta device and back, each module got a parameter of its own: tie the
        # shared ones again (an lm_head tied to the embeddings, which a checkpoint holds
        # once) before anything is loaded into them.
        if callable(getattr(self.model, "tie_weights", None)):
            self.model.tie_weights()
        restored = self._host_weights is not None
        if self._host_weights is not None:
            self.model.load_state_dict(self._host_weights)
        for name, value in self._buffers.items():
            self._buffer_slot(name).copy_(value)
        self._host_weights, self._buffers = None, {}
        self.sleep_level = None
        log.info("awake: weights %s", "restored from the host copy" if restored
                 else "uninitialised until reload_weights")

    def _buffer_slot(self, name: str) -> Any:
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        return getattr(module, attr)

    def reload(self, weights_path: Path) -> None:
        """Copy a Hugging Face checkpoint's tensors into the running model."""
        if self.sleeping:
            raise WeightsError("the weights are asleep: wake_up (tags weights) before a reload")
        state = load_safetensors(weights_path, torch=self.torch)
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise WeightsError(f"{weights_path} holds tensors this model does not have: "
                               f"{unknown[:5]}")
        # Tied weights (lm_head = embed_tokens) are saved once; every other
        # parameter must come from the checkpoint, never stay stale.
        tied = {k for k in own if k not in state and _tied_to_saved(self.model, k, state)}
        missing = sorted(set(own) - set(state) - tied)
        if missing:
            raise WeightsError(f"{weights_path} lacks tensors of this model: {missing[:5]}")
        # Every shape is checked before the first copy: a refused checkpoint
        # leaves the model exactly as it was, never half old and half new.
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise WeightsError(f"{weights_path}: {name} has shape {tuple(tensor.shape)}, "
                                   f"the model's is {tuple(own[name].shape)}")
        with self.torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor.to(own[name].dtype))
        log.info("reloaded %d tensors from %s", len(state), weights_path)


def _tied_to_saved(model: Any, name: str, state: dict[str, Any]) -> bool:
    """Whether parameter `name` shares its storage with one that the checkpoint holds."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    return target is not None and any(
        params.get(other) is target for other in state if other != name)


def load_safetensors(directory: Path, *, torch: Any) -> dict[str, Any]:
    """Every tensor of a checkpoint directory (one file or an index of shards)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted({shard_file(index, name) for name in
                             json.loads(index.read_text())["weight_map"].values()})
            state: dict[str, Any] = {}
            for shard in shards:
                state.update(load_file(str(directory / shard), device="cpu"))
            return state
        return dict(load_file(str(directory / "model.safetensors"), device="cpu"))
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsError(f"cannot read the weights of {directory}: {exc}") from exc
    except Exception as exc:  # safetensors raises its own error type for a corrupt file
        raise WeightsError(f"cannot read the weights of {directory}: "
                           f"{type(exc).__name__}: {exc}") from exc
