"""Metrics that are true for the whole job, not just for rank 0, and a metrics.jsonl writer (and
its rewrite for a resumed run: drop_lines_after). Segmentation's confusion counts and IoU are
common/segmentation/metrics.py's.
"""

import json
import math
import os
import time
from pathlib import Path

import torch

from common.checkpoint import list_checkpoints
from common.config import UserError


class TrainLoss:
    """The training loss of every rank as one sum on the device: one kernel per batch and no
    host sync. It gives the mean since the start, the mean since the last window() (for a
    tracker), and stops the run once the loss has become nan or inf.

        losses = TrainLoss(accelerator.device, step)           # step: optimizer steps done so far
        losses.update(loss, len(x))                            # every batch
        losses.check(accelerator, step, checkpoints_dir)       # every few steps and before saving
        losses.window(accelerator)                             # mean since the last window()
        losses.mean(accelerator)                               # mean since the start

    All but update() are collectives: call them on every rank. A nan or inf stays in the sum,
    so check() finds it even when it runs only every few steps.
    """

    def __init__(self, device, step=0):
        self.sum = torch.zeros((), dtype=torch.float64, device=device)
        self.samples = 0
        self.finite_until = step  # the loss was finite up to this optimizer step
        self.logged = (0.0, 0.0)  # the all-rank sum and count at the last window()

    def update(self, loss, n):
        self.sum.add_(loss.detach(), alpha=n)
        self.samples += n

    def totals(self, accelerator):
        """(loss sum, samples) over all ranks."""
        count = torch.tensor(float(self.samples), dtype=torch.float64, device=self.sum.device)
        return accelerator.reduce(torch.stack([self.sum, count]), "sum").tolist()

    def carry(self, loss_sum, samples, main_process):
        """Start from the all-rank totals of an interrupted epoch's first batches: the main
        process adds them (so the all-rank sum counts them once), and windows start after them."""
        if main_process:
            self.sum += loss_sum
            self.samples += samples
        self.logged = (loss_sum, float(samples))

    def check(self, accelerator, step, checkpoints_dir):
        """Raises UserError on every rank if any rank's loss was nan or inf since the last check."""
        total, _ = self.totals(accelerator)
        if not math.isfinite(total):
            first = self.finite_until + 1
            where = f"at step {step}" if first >= step else f"between steps {first} and {step}"
            found = list_checkpoints(checkpoints_dir)
            kept = f"; the last good checkpoint is {found[-1]}" if found else ""
            raise UserError(
                f"the loss became nan or inf {where}{kept}: lower lr, or check the data"
            )
        self.finite_until = step

    def window(self, accelerator):
        total, count = self.totals(accelerator)
        mean = (total - self.logged[0]) / max(count - self.logged[1], 1.0)
        self.logged = (total, count)
        return mean

    def mean(self, accelerator):
        total, count = self.totals(accelerator)
        return total / max(count, 1.0)


class Throughput:
    """Samples per second of the whole job: every rank's samples over the main process's wall clock.

    speed.update(len(x))           # every batch, on the host
    speed.compute(accelerator)     # a collective: call on every rank
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.samples = 0

    def update(self, n):
        self.samples += n

    def compute(self, accelerator):
        # Summed, not multiplied by the process count: bucketed batches differ in size across ranks.
        samples = accelerator.reduce(
            torch.tensor(float(self.samples), device=accelerator.device), "sum"
        ).item()
        return samples / max(time.perf_counter() - self.start, 1e-9)


class MetricsLog:
    """Appends one JSON object per line to output_dir/metrics.jsonl, on the main process only.
    Each record also gets world_size (the process count, if given) and elapsed_s: seconds since
    this log was opened (the start of the run).

    goes_on_from: for a training run, the (step, epoch) of the checkpoint it resumes from, (0, 1)
    for one that starts afresh. Its first write first drops the lines that the run writes again
    (drop_lines_after): only then has the run trained, so a resume that fails before (another
    batch_size, bad data) leaves the file as it was."""

    def __init__(self, path, enabled, world_size=None, *, goes_on_from=None):
        self.path = Path(path)
        self.enabled = enabled
        self.world_size = world_size
        self.start = time.perf_counter()
        self.goes_on_from = goes_on_from

    def write(self, **record):
        if self.enabled:
            if self.goes_on_from is not None:
                step, epoch = self.goes_on_from
                drop_lines_after(self.path, step=step, epoch=epoch)
                self.goes_on_from = None
            if self.world_size is not None:
                record["world_size"] = self.world_size
            record["elapsed_s"] = round(time.perf_counter() - self.start, 2)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def drop_lines_after(path, *, step, epoch):
    """Rewrite metrics.jsonl for a run that goes on from a checkpoint, without the lines that the
    run writes again. step and epoch: the checkpoint's trainer_state.json, the epoch being the one
    the run resumes in (the next one after an epoch-end checkpoint). The lines that go are those of
    later steps, and those of `epoch` and later epochs (a partial epoch's line, written when
    max_steps stopped the run mid-epoch); an eval_only line (epoch null) goes only if it is of a
    later step. Step 0 is a run that starts afresh: every line goes. The new file replaces the
    old one atomically. Main process only."""
    path = Path(path)
    if not path.is_file():
        return
    if step == 0:
        path.unlink()
        return
    # A last line without its newline was cut short by a killed write: it goes too.
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number} is not JSON: fix or remove it") from None
        again = record["step"] > step or (record["epoch"] is not None and record["epoch"] >= epoch)
        if not again:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def peak_memory_mb(device):
    """Peak memory: on a CUDA device, of the tensors allocated since the last
    reset_peak_memory(); on the CPU, the process's resident set size at its peak so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device):
    """Start peak_memory_mb() afresh from what is allocated now, so that training and evaluation
    each report their own peak. A CUDA device only: a process's peak resident set size cannot be
    reset, so on the CPU the figure stays the peak since the process started."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
