"""MNIST digit classifier: the classic PyTorch example, on any number of processes.

    python recipes/mnist.py --dataset data/mnist_sample --epochs 3          # one process
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/mnist.py
    torchrun --nproc_per_node 2 recipes/mnist.py --dataset data/mnist_sample

The same file runs on CPU, one GPU, many GPUs and fp16/bf16: the accelerate config
decides. Settings are the Config fields below: `--config run.yaml` and `--field value`.
Copy this file to start your own recipe; the `# ADAPT:` comments mark what to change.
"""

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ when run as a script

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from common.checkpoint import choose_checkpoint, load_checkpoint, load_weights, save_checkpoint, save_weights
from common.config import UserError, require, save_config
from common.determinism import set_deterministic
from common.data import DataError, load_splits
from common.metrics import MetricsLog, Throughput, TrainLoss, peak_memory_mb
from common.runtime import (
    build_accelerator, close, describe, elastic_restart, make_output_dir, run, stop_requested, tracker,
)


@dataclass
class Config:
    # Data. ADAPT: a hub name, or a local folder of train*/test* parquet files or train/<label>/*.png.
    dataset: str = "ylecun/mnist"  # hub name or local folder
    image_column: str = "image"  # column holding the images
    label_column: str = "label"  # column holding class indices 0..9
    train_split: str = "train"
    test_split: str = "test"
    output_dir: str = f"runs/{Path(__file__).stem}"  # runs/<file name>: config.yaml, metrics.jsonl, weights, checkpoints/
    # Training. Defaults follow pytorch/examples mnist/main.py (~99% test accuracy after 14 epochs).
    epochs: int = 14
    batch_size: int = 64  # per process: the global batch is this x processes x accumulation steps
    eval_batch_size: int = 1000  # per process
    lr: float = 1.0  # Adadelta learning rate
    gamma: float = 0.7  # learning rate multiplier after every epoch
    gradient_accumulation_steps: int = 1  # optimizer step every N batches
    scale_lr: bool = False  # multiply lr by processes x accumulation steps (the linear scaling rule)
    seed: int = 1  # model init and data order; same seed, same run
    deterministic: bool = False  # bit-repeatable GPU runs, slower (see common/determinism.py)
    num_workers: int = 0  # DataLoader workers per process; the data is already decoded in memory
    data_on_device: bool = True  # keep the decoded images on the GPU (full MNIST: 47 MB) and gather batches there
    max_steps: int = 0  # stop after this many optimizer steps (0: train all epochs)
    # Checkpoints (output_dir/checkpoints/step-N): the full state, for an exact resume.
    checkpoint_every_steps: int = 0  # also write one every N optimizer steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # delete older ones
    resume: Optional[str] = None  # "latest" or a checkpoint folder; torchrun restarts go on from this job's last one
    # Modes.
    smoke: bool = False  # train smoke_steps steps of one epoch, then evaluate: for tests and CI
    smoke_steps: int = 5
    eval_only: bool = False  # evaluate `weights` (or the `resume` checkpoint) on the test split and stop
    weights: Optional[str] = None  # model.safetensors (or a state_dict .pt) to start from
    # Logging (metrics.jsonl is always written).
    log_with: str = "none"  # none, tensorboard (pip install -r requirements-extras.txt) or wandb (pip install wandb)
    log_every: int = 50  # optimizer steps between logged training scalars
    dist_timeout_s: int = 600  # a rank stuck this long in a collective stops the job
    debug: bool = False  # show full tracebacks for user errors

    def validate(self):
        require(self.epochs >= 1, f"epochs must be at least 1, got {self.epochs}")
        require(self.batch_size >= 1, f"batch_size must be at least 1, got {self.batch_size}")
        require(self.eval_batch_size >= 1, f"eval_batch_size must be at least 1, got {self.eval_batch_size}")
        require(self.lr > 0, f"lr must be positive, got {self.lr}")
        require(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be at least 1")
        require(self.num_workers >= 0, f"num_workers cannot be negative, got {self.num_workers}")
        require(self.smoke_steps >= 1, f"smoke_steps must be at least 1, got {self.smoke_steps}")
        require(self.max_steps >= 0 and self.checkpoint_every_steps >= 0, "max_steps and checkpoint_every_steps cannot be negative")
        require(self.log_every >= 1, f"log_every must be at least 1, got {self.log_every}")
        require(self.keep_checkpoints >= 1, f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        require(not (self.weights and self.resume), "weights and resume both load a model: pass one of them")
        require(not self.eval_only or self.weights or self.resume, "eval_only needs --weights FILE or --resume CHECKPOINT")

    def limits(self):
        """(epochs, optimizer steps) the run trains for, counted from its start, also when resumed;
        smoke: smoke_steps steps of one epoch."""
        return (1, self.smoke_steps) if self.smoke else (self.epochs, self.max_steps or math.inf)


# ADAPT: your model. This is the BasicNet of the PyTorch examples, so results compare.
class BasicNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)  # logits


# ADAPT: your data. Images are decoded once into uint8 tensors; batches are normalised on
# the device, which is much cheaper than PIL -> ToTensor -> Normalize for every sample.
MEAN, STD = 0.1307, 0.3081


class TensorBatches(TensorDataset):
    """A TensorDataset that the DataLoader reads a whole batch at a time (`__getitems__`): one
    indexing operation per batch instead of one per sample plus a collate. Its tensors may live
    on the GPU: the sampler still picks the indices (sharding, shuffling, resume are unchanged)
    and the batch is gathered where the data is; only the indices are copied per step."""

    def __getitems__(self, indices):
        indices = torch.as_tensor(indices)
        if self.tensors[0].is_cuda:  # a plain copy to the GPU would wait for all its queued work
            indices = indices.pin_memory().to(self.tensors[0].device, non_blocking=True)
        return tuple(t[indices] for t in self.tensors)


def to_tensors(split, cfg, name, device):
    """A datasets.Dataset of 28x28 grey digits -> TensorBatches(uint8 [N,1,28,28], int64 [N]) on `device`."""
    images = list(split[cfg.image_column])  # decodes every image, once: the column decodes on each read
    bad = next((im for im in images if im.mode != "L" or im.size != (28, 28)), None)
    if bad is not None:
        raise DataError(
            f"{name} split has a {bad.mode} image of size {bad.size[0]}x{bad.size[1]}; BasicNet takes "
            f"28x28 greyscale ('L'): convert the images or change the model's first layer"
        )
    x = torch.from_numpy(np.stack([np.asarray(im) for im in images]))[:, None]
    y = split.select_columns([cfg.label_column]).with_format("numpy")[:][cfg.label_column]
    if y.dtype.kind not in "iu":
        raise DataError(f"{name} split's column {cfg.label_column!r} holds {split.features[cfg.label_column]}, "
                        f"not class indices: map the labels to integers 0..9")
    y = torch.from_numpy(y).long()
    if y.min() < 0 or y.max() > 9:
        raise DataError(f"{name} split has label {int(y.max() if y.max() > 9 else y.min())}; labels must be 0..9")
    return TensorBatches(x.to(device), y.to(device))


def make_loaders(cfg, device="cpu"):
    """Plain single-process DataLoaders for training on `device`; accelerator.prepare() shards
    and reshuffles them. On a GPU the tensors live there (data_on_device) or in pinned memory."""
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and cfg.data_on_device and cfg.num_workers:
        raise UserError("DataLoader workers cannot read data kept on the GPU: set num_workers 0 or data_on_device false")
    pin = on_gpu and not cfg.data_on_device  # host tensors, copied to the GPU per batch
    device = device if cfg.data_on_device else "cpu"
    splits = load_splits(cfg.dataset, [cfg.train_split, cfg.test_split], [cfg.image_column, cfg.label_column])
    train_set = to_tensors(splits[cfg.train_split], cfg, cfg.train_split, device)
    test_set = to_tensors(splits[cfg.test_split], cfg, cfg.test_split, device)
    # Each loader gets its own generator: starting an epoch then draws from it rather than from
    # the global RNG that dropout uses, so a resumed run sees the same dropout masks as an
    # uninterrupted one (an extra draw at resume would shift them all).
    # collate_fn=tuple: TensorBatches already returns the batch as (images, labels).
    train_loader = DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=cfg.num_workers, collate_fn=tuple,
                              pin_memory=pin, generator=torch.Generator().manual_seed(cfg.seed))
    test_loader = DataLoader(test_set, cfg.eval_batch_size, num_workers=cfg.num_workers, collate_fn=tuple,
                             pin_memory=pin, generator=torch.Generator().manual_seed(cfg.seed))
    return train_loader, test_loader


def normalize(x):
    return (x.float() / 255 - MEAN) / STD


# The settings that decide which batches each process trains on, and in which order: a checkpoint
# written mid-epoch resumes only with the same values (and the same number of processes).
DATA_ORDER = ("dataset", "train_split", "seed", "batch_size", "gradient_accumulation_steps")


def save(accelerator, cfg, progress, scheduler):
    """A checkpoint: Accelerate's state plus where we are in the data and the LR schedule."""
    state = {"recipe": "mnist", "world_size": accelerator.num_processes, **{k: getattr(cfg, k) for k in DATA_ORDER},
             **progress, "scheduler": scheduler.state_dict()}
    return save_checkpoint(accelerator, Path(cfg.output_dir) / "checkpoints", progress["step"], state,
                           cfg.keep_checkpoints)


def train_one_epoch(model, loader, optimizer, scheduler, accelerator, cfg, progress):
    """One pass over this process's shard (or what is left of it after a resume).

    `progress` (epoch, batches_done, step) is updated in place. Returns the epoch's metrics and
    whether to stop: max_steps reached, or Ctrl-C / SIGTERM (a checkpoint is written first).
    A nan or inf loss stops the run before it can be written into a checkpoint.
    """
    model.train()
    losses, skipped, stop = TrainLoss(accelerator.device, progress["step"]), 0, False
    speed, window_speed = Throughput(), Throughput()
    checkpoints = Path(cfg.output_dir) / "checkpoints"
    _, max_steps = cfg.limits()
    # Accelerate divides every loss by gradient_accumulation_steps. When that does not divide the
    # epoch's batches, the last group is shorter: its losses weigh more, so that its step too gets
    # the mean gradient of its batches.
    batches, group = progress["batches_done"] + len(loader), cfg.gradient_accumulation_steps
    short_from, short = batches - batches % group, batches % group
    for x, y in tqdm(loader, f"epoch {progress['epoch']}", disable=not accelerator.is_main_process, leave=False):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(normalize(x)), y)
            accelerator.backward(loss if progress["batches_done"] < short_from else loss * group / short)
            optimizer.step()
            optimizer.zero_grad()
        progress["batches_done"] += 1
        losses.update(loss, len(y))  # one kernel, no host sync: bookkeeping must not slow small models
        speed.update(len(y))
        window_speed.update(len(y))
        if not accelerator.sync_gradients:  # still accumulating
            continue
        progress["step"] += 1
        skipped += accelerator.optimizer_step_was_skipped  # fp16: the scaler skipped an overflowing step
        if cfg.log_with != "none" and progress["step"] % cfg.log_every == 0:  # all ranks: window() is a collective
            accelerator.log({"train/loss": losses.window(accelerator), "train/lr": optimizer.param_groups[0]["lr"],
                             "train/samples_per_s": window_speed.compute(accelerator)},
                            step=progress["step"])
            window_speed = Throughput()
        stop = stop_requested(accelerator, progress["step"]) or progress["step"] >= max_steps
        checkpoint = cfg.checkpoint_every_steps and progress["step"] % cfg.checkpoint_every_steps == 0
        if stop or checkpoint or progress["step"] % 10 == 0:
            losses.check(accelerator, progress["step"], checkpoints)  # a nan loss never reaches a checkpoint
        if stop or checkpoint:
            save(accelerator, cfg, progress, scheduler)
        if stop:
            break
    losses.check(accelerator, progress["step"], checkpoints)  # before the epoch-end checkpoint
    return {
        "train_loss": losses.mean(accelerator),
        "train_samples_per_s": speed.compute(accelerator),
        "skipped_steps": skipped,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
    }, stop


@torch.inference_mode()
def evaluate(model, loader, accelerator):
    """Exact accuracy over the whole test split, on any number of processes.

    The prepared loader pads the last batch so every rank gets one; gather_for_metrics
    drops that padding, so each test sample is counted exactly once.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # correct, loss sum, samples
    for x, y in loader:
        logits = model(normalize(x))
        loss = F.cross_entropy(logits, y, reduction="none")
        preds, y, loss = accelerator.gather_for_metrics((logits.argmax(1), y, loss))
        totals[0] += (preds == y).sum()
        totals[1] += loss.sum()
        totals[2] += len(y)
    correct, loss_sum, samples = totals.tolist()  # the only wait for the GPU
    return {"accuracy": correct / samples, "eval_loss": loss_sum / samples, "eval_samples": int(samples)}


def main(cfg):
    # 1. Runtime: processes and precision come from the accelerate config.
    out = make_output_dir(cfg.output_dir)
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed, cfg.dist_timeout_s,
                                    log_with=tracker(cfg.log_with), project_dir=out)
    set_seed(cfg.seed)
    set_deterministic(cfg.deterministic)
    checkpoint = choose_checkpoint(cfg.resume, out / "checkpoints", cfg.eval_only, restarted=elastic_restart())
    if accelerator.is_main_process and not cfg.eval_only:  # eval_only keeps the training run's config
        save_config(cfg, out / "config.yaml")
    if cfg.resume == "latest" and not checkpoint:
        accelerator.print(f"resume latest: no checkpoint in {out / 'checkpoints'} yet, so training starts at step 0")
    accelerator.init_trackers("mnist", config=asdict(cfg))  # TensorBoard or wandb, if log_with says so
    metrics = MetricsLog(out / "metrics.jsonl", accelerator.is_main_process)

    # 2. Data: every process loads it (the datasets cache is locked, so one download serves all;
    # bad data then fails the same way on every rank) and prepare() below gives each a shard.
    train_loader, test_loader = make_loaders(cfg, accelerator.device)
    global_batch = cfg.batch_size * accelerator.num_processes
    if len(train_loader.dataset) < global_batch:
        raise DataError(
            f"the {cfg.train_split} split has {len(train_loader.dataset)} samples, fewer than one global batch "
            f"({cfg.batch_size} x {accelerator.num_processes} processes): lower batch_size"
        )

    # 3. Model and optimizer.
    model = BasicNet()
    if cfg.weights:
        load_weights(model, cfg.weights)
    lr = cfg.lr * (accelerator.num_processes * cfg.gradient_accumulation_steps if cfg.scale_lr else 1)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    # Stepped once per epoch, so it is not prepared: a prepared scheduler steps once per process.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    accelerator.print(
        f"mnist: {describe(accelerator, cfg.batch_size)}; "
        f"lr {lr:g}; {len(train_loader.dataset)} train / {len(test_loader.dataset)} test samples; outputs to {out}/"
    )

    # 4. Resume: weights, optimizer, RNG of every rank, LR schedule, and the position in the data.
    progress = {"epoch": 1, "batches_done": 0, "step": 0, "best_accuracy": -1.0}
    if checkpoint:
        order = None if cfg.eval_only else {k: getattr(cfg, k) for k in DATA_ORDER}  # eval_only reads no batches
        state = load_checkpoint(accelerator, checkpoint, "mnist", order)
        scheduler.load_state_dict(state["scheduler"])
        progress = {k: state[k] for k in progress}
        accelerator.print(f"resumed from {checkpoint} (epoch {progress['epoch']}, step {progress['step']})")

    # 5. Train, evaluating after every epoch.
    epochs, max_steps = cfg.limits()
    result, interrupted = None, False
    while not cfg.eval_only and progress["epoch"] <= epochs and progress["step"] < max_steps:
        epoch = progress["epoch"]
        train_loader.set_epoch(epoch)  # a new order every epoch, the same on every rank
        loader = train_loader
        if progress["batches_done"]:  # resumed mid-epoch: skip what this epoch already trained on
            loader = accelerator.skip_first_batches(train_loader, progress["batches_done"])
        lr = scheduler.get_last_lr()[0]
        train, stop = train_one_epoch(model, loader, optimizer, scheduler, accelerator, cfg, progress)
        interrupted = stop and stop_requested(accelerator, 0)
        if interrupted:
            break
        result = evaluate(model, test_loader, accelerator)
        if progress["batches_done"] == len(train_loader):  # the epoch is complete (max_steps may end it too)
            scheduler.step()
            progress.update(epoch=epoch + 1, batches_done=0)
            if result["accuracy"] > progress["best_accuracy"]:
                progress["best_accuracy"] = result["accuracy"]
                save_weights(accelerator, model, out / "best.safetensors", {"recipe": "mnist", "epoch": epoch, **result})
            save(accelerator, cfg, progress, scheduler)
        metrics.write(epoch=epoch, step=progress["step"], world_size=accelerator.num_processes, lr=lr,
                      **train, **result)
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=progress["step"])
        accelerator.print(
            f"epoch {epoch}: train loss {train['train_loss']:.4f}, test accuracy {result['accuracy']:.4f} "
            f"({result['eval_samples']} samples), {train['train_samples_per_s']:.0f} samples/s"
        )

    if interrupted:
        accelerator.print(f"stopped at step {progress['step']}; continue with --resume latest")
    else:
        if result is None:  # eval_only, or a resumed run that had nothing left to train
            result = evaluate(model, test_loader, accelerator)
            metrics.write(epoch=None, step=progress["step"], world_size=accelerator.num_processes,
                          weights=str(cfg.weights or checkpoint), **result)
        if not cfg.eval_only:
            save_weights(accelerator, model, out / "model.safetensors", {"recipe": "mnist"})
        accelerator.print(
            f"test accuracy {result['accuracy']:.4f} on {result['eval_samples']} samples; outputs in {out}/"
        )

    # 6. Exit cleanly: drop what holds the process group, then close it.
    del model, optimizer, train_loader, test_loader
    close(accelerator)


if __name__ == "__main__":
    run(main, Config)
