"""Exact evaluation on any number of processes: every sample counted once, whatever the loader.

    net = evaluation_model(model, accelerator, bucketed=False)  # in eval mode
    sums = ExactSums(accelerator, bucketed=False)
    for x, y in loader:
        logits = net(x)
        loss, correct = sums.each_sample(loss_per_sample, correct_per_sample)
        sums.add(loss=loss, correct=correct)
    totals = sums.totals()       # {"loss": ..., "correct": ..., "samples": ...} of every process

Two kinds of loader need two ways, and these two hide which:
- a prepared loader (accelerator.prepare) deals each process the same number of batches and pads
  the last with repeats: each batch's per-sample values are gathered, and gather_for_metrics drops
  the repeats, so every process sums every sample once;
- a bucketed loader (common/sampler.py: batches of similar sizes) repeats nothing, but may give
  the processes different numbers of batches: nothing may wait on another process per batch
  (neither a gather nor DDP's forward, which syncs buffers), so each sums its own samples with the
  unwrapped model and one reduce adds them up at the end.
"""

import torch
from accelerate.utils import broadcast


def evaluation_model(model, accelerator, *, bucketed):
    """The model in eval mode, as evaluation calls it. bucketed: unwrapped from DDP, which would
    wait on the other processes in every forward, with rank 0's BatchNorm statistics on every
    process, as DDP's forward would have broadcast them."""
    if not bucketed:
        return model.eval()
    # keep_torch_compile=False: the default takes DDP out of a compiled model (Accelerate 1.15).
    net = accelerator.unwrap_model(model, keep_torch_compile=False).eval()
    broadcast(list(net.buffers()))
    return net


class ExactSums:
    """Sums over every evaluation sample of the job, each counted once (see the module's doc).
    each_sample() takes a batch's per-sample tensors (first dimension: the batch) and gives them
    back gathered from every process, or this process's own with a bucketed loader; add() sums
    them over that dimension, in float64 (int64 for integers); totals() gives the sums of the
    whole job, and the number of samples, as "samples"."""

    def __init__(self, accelerator, *, bucketed):
        self.accelerator, self.bucketed = accelerator, bucketed
        self.sums = {"samples": torch.zeros((), dtype=torch.int64, device=accelerator.device)}

    def each_sample(self, *tensors):
        if not self.bucketed:
            tensors = self.accelerator.gather_for_metrics(tensors)
        self.sums["samples"] += len(tensors[0])
        return tensors if len(tensors) > 1 else tensors[0]

    def add(self, **per_sample):
        for name, values in per_sample.items():
            kind = torch.int64 if not values.is_floating_point() else torch.float64
            total = values.to(kind).sum(0)
            self.sums[name] = self.sums[name] + total if name in self.sums else total

    def totals(self):
        """{name: the job's sum}: plain numbers for scalars, tensors for the rest."""
        sums = self.sums
        if self.bucketed:  # the one wait: every process's sums added up
            sums = {k: self.accelerator.reduce(v, "sum") for k, v in sums.items()}
        return {k: v.item() if v.dim() == 0 else v for k, v in sums.items()}
