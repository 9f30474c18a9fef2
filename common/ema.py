"""An exponential moving average (EMA) of a model's weights, as timm and torchvision's references
keep one: after every optimizer step, ema = decay * ema + (1 - decay) * weights.

    ema = EMA.of(model, accelerator, cfg.ema_decay)   # after prepare(); None for decay 0
    ...
    optimizer.step()                               # then, once per optimizer step:
    ema.update()
    ...
    evaluate(ema.synced(accelerator), ...)         # every rank, in the same order

The average covers the parameters and the floating-point buffers (BatchNorm's running mean and
variance); integer buffers (BatchNorm's batch count) are copied. One foreach kernel per update
and no host sync. Under DDP every rank averages its own unwrapped model: the parameters are the
same on every rank, the BatchNorm buffers are each rank's own, so synced() gives every rank rank
0's before an evaluation, as DDP's forward does for the model.
"""

import copy

import torch
from accelerate.utils import broadcast


class EMA:
    def __init__(self, model, decay):
        """model: the plain (unwrapped) model being trained, on its device. The average starts
        as a copy of it, which also keeps its forward (autocast under mixed precision)."""
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        pairs = list(zip(self.module.parameters(), model.parameters()))
        pairs += list(zip(self.module.buffers(), model.buffers()))
        self.averaged = [(e, m) for e, m in pairs if e.is_floating_point()]
        self.copied = [(e, m) for e, m in pairs if not e.is_floating_point()]

    @classmethod
    def of(cls, model, accelerator, decay):
        """The EMA of a prepared model's unwrapped weights, registered with the accelerator so
        that it is part of every checkpoint (an exact resume); None for decay 0 (no average)."""
        if not decay:
            return None
        ema = cls(accelerator.unwrap_model(model, keep_torch_compile=False), decay)
        accelerator.register_for_checkpointing(ema)
        return ema

    @torch.no_grad()
    def update(self):
        """Move the average towards the model's current weights: call after each optimizer step."""
        if self.averaged:
            ema, live = zip(*self.averaged)
            torch._foreach_lerp_(ema, live, 1 - self.decay)
        for ema, live in self.copied:
            ema.copy_(live)

    def synced(self, accelerator):
        """The averaged model, with rank 0's buffers on every rank (a collective)."""
        buffers = list(self.module.buffers())
        if buffers and accelerator.num_processes > 1:
            broadcast(buffers)
        return self.module

    # For accelerator.register_for_checkpointing(): saved and restored with every checkpoint.
    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state):
        self.module.load_state_dict(state)
