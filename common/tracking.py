"""Where a run's numbers go: config.yaml and metrics.jsonl in output_dir, and the tracker that
log_with names (TensorBoard or wandb), checked before the run starts.

    log_with = tracker(cfg.log_with)                    # for Accelerator(log_with=...)
    metrics = start_logging(accelerator, cfg, "mnist")  # config.yaml, trackers, metrics.jsonl
    metrics.write(epoch=1, step=step, **result)         # a line of metrics.jsonl
    accelerator.log({"eval/accuracy": 0.98}, step=step)  # to the tracker, if any
"""

import dataclasses
import importlib.util
from pathlib import Path

from common.config import UserError, save_config
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
