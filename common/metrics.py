"""Metrics that are true for the whole job, not just for rank 0, and a metrics.jsonl writer."""

import json
import time
from pathlib import Path

import torch


class RunningMean:
    """Sum and count kept on the device; `compute` reduces over all ranks once, not every step.

        loss_mean = RunningMean(accelerator.device)
        loss_mean.update(loss.detach(), n=len(x))   # no host sync here
        loss_mean.compute(accelerator)              # mean over every sample of every rank
    """

    def __init__(self, device):
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, value, n=1):
        self.total += value.double() * n
        self.count += n

    def compute(self, accelerator):
        total, count = accelerator.reduce(torch.stack([self.total, self.count]), "sum").tolist()
        return total / max(count, 1.0)


class Throughput:
    """Samples per second over all ranks, measured on the main process's wall clock."""

    def __init__(self):
        self.start = time.perf_counter()
        self.samples = 0

    def update(self, n):
        self.samples += n

    def compute(self, num_processes):
        return self.samples * num_processes / max(time.perf_counter() - self.start, 1e-9)


class MetricsLog:
    """Appends one JSON object per line to output_dir/metrics.jsonl, on the main process only."""

    def __init__(self, path, enabled):
        self.path = Path(path)
        self.enabled = enabled

    def write(self, **record):
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def peak_memory_mb(device):
    """Peak memory so far: allocated tensors on a CUDA device, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
