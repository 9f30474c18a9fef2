"""Where a run's numbers go: config.yaml and metrics.jsonl in output_dir, the tracker that
log_with names (TensorBoard or wandb), checked before the run starts; the segmentation panels it
shows are common/segmentation/panels.py's.

    log_with = tracker(cfg.log_with)                    # for Accelerator(log_with=...)
    out, checkpoint = open_run(accelerator, cfg)        # checkpoint: None to start afresh
    metrics = start_logging(accelerator, cfg, "mnist", checkpoint=checkpoint)  # logs go on there
    metrics.write(epoch=1, step=step, **result)         # a line of metrics.jsonl
    accelerator.log({"eval/accuracy": 0.98}, step=step)  # to the tracker, if any
"""

import dataclasses
import importlib.util
import json
import secrets
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
        raise UserError(
            f"log_with {log_with} needs the {TRACKERS[log_with]} package: "
            f"pip install -r requirements-extras.txt"
        )
    return log_with


def start_logging(accelerator, cfg, name, *, checkpoint=None):
    """Write config.yaml (the settings as resolved, so --config repeats the run), start the
    trackers that log_with names, and return the metrics.jsonl writer.

    checkpoint: the one the run goes on from (open_run's), None for a run that starts afresh.
    A training run's logs go on from there too: TensorBoard hides the points logged after the
    checkpoint's step (its purge_step), wandb continues the run whose id output_dir/wandb_run_id
    holds, and metrics.jsonl loses the lines that the run writes again. A run that starts afresh
    starts them afresh. eval_only keeps the training run's config.yaml and metrics.jsonl and
    starts a new tracker run."""
    out = Path(cfg.output_dir)
    main_process = accelerator.is_main_process
    init_kwargs = {"wandb": {"dir": str(out)}}  # output_dir/wandb/, not ./wandb/
    if not cfg.eval_only:
        step, epoch = resumed_at(checkpoint)  # read on every rank: a bad file stops all alike
        # SummaryWriter hides what the files already hold from this step on: the run logs it again.
        init_kwargs["tensorboard"] = {"purge_step": step + 1}
        if main_process:
            save_config(cfg, out / "config.yaml")
            if cfg.log_with == "wandb":
                run_id = wandb_run_id(out, resumed=checkpoint is not None)
                init_kwargs["wandb"].update(id=run_id, resume="allow")
    # Nothing happens here unless log_with names a tracker; trackers start on the main process.
    accelerator.init_trackers(name, config=dataclasses.asdict(cfg), init_kwargs=init_kwargs)
    return MetricsLog(
        out / "metrics.jsonl",
        main_process,
        accelerator.num_processes,
        goes_on_from=None if cfg.eval_only else (step, epoch),
    )


def resumed_at(checkpoint):
    """(step, epoch) where a run goes on from `checkpoint`, as its trainer_state.json says:
    (0, 1) for None, a run that starts afresh."""
    if checkpoint is None:
        return 0, 1
    state_file = Path(checkpoint) / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{checkpoint} is not a complete checkpoint (no trainer_state.json): pass another "
            f"--resume"
        ) from None
    except json.JSONDecodeError:
        raise UserError(f"{state_file} is corrupt: resume from an earlier checkpoint") from None
    return state["step"], state["epoch"]


def wandb_run_id(out, *, resumed):
    """The id of the wandb run that output_dir logs to, kept in output_dir/wandb_run_id: a
    resumed run reads it back, so that it goes on logging into that run; a run that starts
    afresh (or resumes without the file: it logged to no wandb run yet) writes a new one.
    Main process only."""
    path = Path(out) / "wandb_run_id"
    if resumed and path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # 12 hex digits: as unlikely to repeat as wandb's own ids
    path.write_text(run_id + "\n")
    return run_id


def as_rgb(x):
    """uint8 images [N, C, H, W] of any channels as RGB: grey for 1 or 2, without alpha for 4."""
    return x[:, :3] if x.shape[1] >= 3 else x[:, [0, 0, 0]]


def save_labelled(images, labels, path, *, columns=8, zoom=3):
    """One PNG of uint8 images [N, C, H, W] in a grid of `columns`, each enlarged `zoom` times
    with its label written under it: a classifier's data, to look at before training."""
    from PIL import Image, ImageDraw

    n, _, h, w = images.shape
    cell_w, cell_h = w * zoom + 8, h * zoom + 16
    rows = -(-n // columns)
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (image, label) in enumerate(zip(as_rgb(images.cpu()), labels)):
        tile = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((w * zoom, h * zoom))
        left, top = (i % columns) * cell_w + 4, (i // columns) * cell_h + 2
        sheet.paste(tile, (left, top))
        draw.text((left, top + h * zoom + 1), str(label)[:20], fill="black")
    sheet.save(path)
