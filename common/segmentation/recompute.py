"""Gradient checkpointing that leaves BatchNorm's running statistics as one forward left them.

    x = recompute(block, x)         # in a model's forward: block(x), its activations recomputed

recompute(module, *inputs) returns module(*inputs). While the module trains with gradients on,
it keeps only the inputs for backward and runs the module again there, when backward needs the
activations (torch.utils.checkpoint.checkpoint, use_reentrant=False): less memory for one more
forward. Otherwise it simply calls the module.

A BatchNorm layer in training mode updates running_mean, running_var and num_batches_tracked
on every forward, so a plain checkpoint would update them twice a step: once in the forward and
once more in the recompute, and the statistics that evaluation uses would drift from those of a
run without checkpointing. While it recomputes, each BatchNorm layer of the module (SyncBatchNorm
included) holds copies of its three buffers, and gets its own back afterwards: the copies take
the second update and are thrown away.

Why copies and not track_running_stats=False for the recompute: in training mode both normalise
with the batch's statistics and give the same output, but without running statistics
F.batch_norm runs another aten kernel (_native_batch_norm_legit.no_stats) that saves fewer
tensors for backward than the forward's, and checkpoint matches the recomputed tensors to the
forward's by their order: it stops with "A different number of tensors was saved". With copies
the recompute runs the same kernels on tensors of the same shapes.

Under torch.compile the recompute happens inside the compiled backward, which does not update the
statistics a second time: there recompute() is a plain checkpoint.
"""

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def recompute(module, *inputs):
    """module(*inputs), keeping only the inputs for backward when the module trains with
    gradients on. module: the nn.Module that runs; its BatchNorm layers are the ones whose
    statistics the recompute leaves alone, so it must hold every layer that the call runs."""
    if not (module.training and torch.is_grad_enabled()):
        return module(*inputs)
    if torch.compiler.is_compiling():
        # Compiled, the recompute is part of the compiled backward, which does not update the
        # statistics again; and torch.compile takes no context_fn but TorchDispatchModes.
        return checkpoint(module, *inputs, use_reentrant=False)
    return checkpoint(
        module,
        *inputs,
        use_reentrant=False,  # the non-reentrant checkpoint is the one that takes context_fn
        context_fn=lambda: (contextlib.nullcontext(), spare_statistics(module)),
    )


@contextlib.contextmanager
def spare_statistics(module):
    """For the duration of the block, every BatchNorm layer of module that tracks running
    statistics updates copies of them; the layer gets its own tensors back afterwards, also when
    the block is left by an exception (checkpoint stops a recompute early by raising one)."""
    layers = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    kept = [[getattr(m, name) for name in STATISTICS] for m in layers]
    for layer, tensors in zip(layers, kept):
        for name, tensor in zip(STATISTICS, tensors):
            setattr(layer, name, tensor.clone())  # a registered buffer: replaced in _buffers
    try:
        yield
    finally:
        for layer, tensors in zip(layers, kept):
            for name, tensor in zip(STATISTICS, tensors):
                setattr(layer, name, tensor)
