"""Where a run's numbers go: config.yaml and metrics.jsonl in output_dir, the tracker that
log_with names (TensorBoard or wandb), checked before the run starts, and the segmentation panels
it shows.

    log_with = tracker(cfg.log_with)                    # for Accelerator(log_with=...)
    metrics = start_logging(accelerator, cfg, "mnist")  # config.yaml, trackers, metrics.jsonl
    metrics.write(epoch=1, step=step, **result)         # a line of metrics.jsonl
    accelerator.log({"eval/accuracy": 0.98}, step=step)  # to the tracker, if any
    panel = image_panel(x, logits, y, num_classes)      # image | prediction | truth, floats
"""

import dataclasses
import importlib.util
from pathlib import Path

import torch

from common.config import UserError, save_config
from common.inference import predicted_classes
from common.metrics import MetricsLog

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # log_with value -> package it needs


def tracker(log_with):
    """The `log_with` setting as Accelerate takes it (None for "none"), checked before the run
    starts: a missing package is a one-line error, not a failure at the first log call."""
    if log_with == "none":
        return None
    if log_with not in TRACKERS:
        raise UserError(f"log_with must be none, {' or '.join(TRACKERS)}, got {log_with!r}")
    if importlib.util.find_spec(TRACKERS[log_with]) is None:
        hint = "-r requirements-extras.txt" if log_with == "tensorboard" else TRACKERS[log_with]
        raise UserError(
            f"log_with {log_with} needs the {TRACKERS[log_with]} package: pip install {hint}"
        )
    return log_with


def start_logging(accelerator, cfg, name):
    """Write config.yaml (the settings as resolved, so --config repeats the run), start the
    trackers that log_with names, and return the metrics.jsonl writer. eval_only keeps the
    training run's config.yaml."""
    out = Path(cfg.output_dir)
    if accelerator.is_main_process and not cfg.eval_only:
        save_config(cfg, out / "config.yaml")
    # Nothing happens here unless log_with names a tracker.
    accelerator.init_trackers(name, config=dataclasses.asdict(cfg))
    return MetricsLog(out / "metrics.jsonl", accelerator.is_main_process, accelerator.num_processes)


# Class 0 (and padding) black, then a colour per class, repeating after six.
COLOURS = torch.tensor(
    [
        (0, 0, 0),
        (230, 25, 75),
        (60, 180, 75),
        (0, 130, 200),
        (255, 225, 25),
        (145, 30, 180),
        (70, 240, 240),
    ],
    dtype=torch.uint8,
)


def paint(classes):
    """Class indices [..., H, W] -> uint8 colours [..., H, W, 3]."""
    classes = classes.clamp(min=0)
    index = torch.where(classes > 0, (classes - 1) % (len(COLOURS) - 1) + 1, 0)
    return COLOURS.to(classes.device)[index]


def image_panel(x, logits, target, num_classes, count=4):
    """image | prediction | truth of the first `count` images, side by side: floats
    [N, 3, H, 3W]. x: uint8 images of any channels, shown as RGB (grey for 1 or 2, without
    alpha for 4)."""
    pred = predicted_classes(logits[:count], num_classes)
    painted = [paint(c).permute(0, 3, 1, 2) for c in (pred, target[:count])]
    rgb = x[:count, :3] if x.shape[1] >= 3 else x[:count, [0, 0, 0]]
    return torch.cat([rgb, *painted], dim=3).float() / 255
