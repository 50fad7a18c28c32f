"""bf16 parameters with fp32 optimizer state (`train.param_dtype = "bfloat16"`).

    the model's parameters      bf16: what forward and backward use, what FSDP2
                                shards and all-gathers
    the optimizer's parameters  an fp32 copy of each (same sharding: a DTensor's
                                copy is a DTensor of the same placement), with
                                AdamW's moments in fp32
    step                        bf16 grads -> fp32 copies' grads -> AdamW ->
                                fp32 copies -> cast into the bf16 parameters

Small updates that bf16 would round away accumulate in the fp32 copies, which a
resident trainer keeps from one iteration to the next and the training state
saves; a checkpoint holds the weights in the model's own dtype whatever the
parameters' (trainer/checkpoint.py saved_dtype).
The class answers to what the trainer asks of an optimizer (param_groups,
state, state_dict, load_state_dict, zero_grad, step), so optimizer-state
saving and restoring (optim_state.py) work on the fp32 copies unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class MasterWeightsAdamW:
    def __init__(self, params: Iterable[nn.Parameter], **adamw: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float(), requires_grad=True)
                        for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, **adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, master in zip(self.params, self.masters, strict=True):
            p.copy_(master)
