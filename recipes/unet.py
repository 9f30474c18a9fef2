"""U-Net semantic segmentation, as in milesial/Pytorch-UNet, on any number of processes.

    make data/shapes && python recipes/unet.py --epochs 10        # one process, the default data
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/unet.py --images DIR \
        --masks DIR --mask_name "{stem}_mask.png"               # your folders: docs/unet.md
    python recipes/unet_predict.py --weights runs/unet/model.safetensors "photos/*.jpg" --overlay

The accelerate config picks CPU, GPUs and fp16/bf16. Settings: the Config fields below (the
model's in unet_model.py) and common.config's RunConfig, by `--config run.yaml` and `--field
value`. This file trains; predict, export and the data check are unet_predict.py's, which it
never imports; what the settings and the data decide (checks, auto rules, start-up notes) is
unet_rules.py's. Copy these files to start your own recipe (`make copy RECIPE=unet ...`);
`# ADAPT:` marks what to change: here, in unet_data.py (the data) and unet_model.py (the model).
"""

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, ReduceLROnPlateau
from tqdm.auto import tqdm

from common.accelerator import (
    accelerator_for,
    busy_cores_note,
    close,
    describe,
    from_main_process,
    fused_kernels,
    sync_batchnorm,
)
from common.checkpoint import (
    fit_to_record,
    load_weights,
    record_metadata,
    resume_or_start,
    save_best,
    save_final,
    save_training,
)
from common.config import RunConfig, require
from common.determinism import set_deterministic
from common.ema import EMA
from common.evaluation import ExactSums, evaluation_model
from common.metrics import peak_memory_mb, reset_peak_memory
from common.outputs import open_run, write_csv
from common.progress import Progress
from common.runtime import hand_over, run
from common.schedule import HeldCosine
from common.segmentation.augment import colour_jitter, crop_and_flip, zoom_and_rotate
from common.segmentation.data import (
    IGNORE,
    MODES,
    RECORD,
    FirstPairs,
    load_segmentation,
    read_weights_record,
    value_count,
    weights_record,
)
from common.segmentation.inference import segment
from common.segmentation.metrics import class_scores, confusion_counts
from common.segmentation.panels import image_panel
from common.signals import catch_stop_signals
from common.tracking import start_logging
from unet_data import (  # ADAPT: your data
    Pairs,
    check_data_settings,
    list_pairs,
    mask_classes,
)
from unet_model import (  # ADAPT: your model
    MIN_SIZE,
    MODEL_SETTINGS,
    PAD_MULTIPLE,
    ModelConfig,
    build_model,
    input_channels,
    prepare_input,
)
from unet_rules import (  # what the settings and the data decide
    OVERFIT,
    check_settings,
    class_weights,
    flips_to_average,
    image_size,
    overfit_verdict,
    resolved,
    start_up_notes,
)

NAME = Path(__file__).stem  # a copy gets its own name in checkpoints, trackers and output_dir
INFERRED = ("in_channels", "num_classes")  # model settings that the data decides when 0
SERVING = Path(__file__).with_name(f"{NAME}_predict.py")  # predict, export, the data check


@dataclass
class Config(ModelConfig, RunConfig):  # ModelConfig: the model's settings, in unet_model.py
    # Data. ADAPT: a folder with imgs/ and masks/ (imgs/NAME.jpg with masks/NAME.png or
    # masks/NAME_mask.gif, as Carvana), or a hub name / folder that datasets.load_dataset reads.
    dataset: str = "data/shapes"  # `make data/shapes` writes it (scripts/make_shapes.py)
    # Or any folders of images and masks, by name (docs/unet.md: Pet, ISIC, CamVid, VOC).
    images: str = ""  # the training images: a folder, or a glob such as data/x/*.jpg
    masks: str = ""  # the folder of their masks (or a glob of the mask files)
    mask_name: str = ""  # a mask's file name from its image's stem, e.g. {stem}_L.png; "": {stem}.*
    val_images: str = (
        ""  # validation images (masks in val_masks, else masks); "": taken from images
    )
    val_masks: str = ""  # the folder of val_images' masks; "": masks
    train_list: str = ""  # a file of the training images' names, one a line (VOC's train.txt)
    val_list: str = ""  # a file of the validation images' names among images (Pet's test.txt)
    val_fraction: float = 0.1  # else: the share held out for validation, fixed for any seed
    image_column: str = "image"  # datasets data: the column of images
    mask_column: str = "mask"  # datasets data: the column of masks
    train_split: str = "train"  # datasets data
    val_split: str = "validation"  # datasets data
    output_dir: str = f"runs/{NAME}"  # config.yaml, metrics.jsonl, weights, checkpoints/
    # Classes: a mask holds a grey level, palette index or label id per class, or a colour.
    mask_values: str = ""  # in class order, e.g. 0,255 or #000000,#800000; empty: those found
    ignore_index: str = ""  # mask values (or class names) that count for nothing, e.g. 255 (VOC)
    ignore_unlisted: bool = False  # and every value not in mask_values (Cityscapes' 34 ids)
    num_classes: int = 0  # with background; 0: one per mask value; 1: a sigmoid, for 2 values
    class_names: str = ""  # a,b,c in class order, or a file: a name a line, or name,r,g,b (CamVid)
    background: str = ""  # the class dice leaves out: a mask value or name; "": the most pixels
    # Size and augmentation: an image and its mask get the same resize (at decoding), crop, flips.
    image_size: str = ""  # resize to SIZE x SIZE, or HxW (height x width); empty: the files' size
    scale: float = 0.0  # resize each image by this factor, keeping its aspect ratio; 0: no resize
    crop_size: int = 0  # training only: a random square crop after the resize; 0: no crop
    hflip: float | None = None  # training: flip probability; auto: 0.5, 0 if a flip changes a class
    vflip: float = 0.0  # training only: probability of a vertical flip
    zoom: float | None = None  # training: resize by 1/(1+zoom)..1+zoom; auto: 0.25 digits, else 0
    rotate: float = 0.0  # training only: rotate by up to this many degrees either way
    fill: str = "reflect"  # zoom, rotate: the image past its edges: reflect (mirrored) or zeros
    jitter: float = 0.0  # training only: brightness, contrast, saturation x a factor 1 +- jitter
    copy_paste: float | None = None  # training: share pasted on; auto: 0.5 objects on a background
    # Images of different sizes: train and evaluate each at its own size, in similar-size batches.
    bucket_by_size: bool = False  # batches padded to their largest image, which loss and Dice skip
    max_batch_pixels: int = 0  # bucket_by_size: padded pixels per batch; 0: batch_size x largest
    # Decoding: once at start-up, into memory (a GPU's with CUDA), or at every read in workers.
    cache_images: bool | None = None  # auto: decode once if images + masks take <= 4 GiB
    cache_decoded: bool = True  # cache_images: keep the decoded tensors on disk for later runs
    num_workers: int = -1  # DataLoader workers per process that decode (if not cached); -1: by CPUs
    # Training.
    epochs: int = 5
    sync_bn: bool = True  # BatchNorm statistics over all processes' batches (GPUs only)
    batch_size: int = 8  # per process (global_batch_size: at most); x processes x accumulation
    eval_batch_size: int = 0  # per process; 0: a training batch's pixels (predict: batch_size)
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    scheduler: str = "hold_cosine"  # lr held 70%, then cosine to 0; or cosine, constant, plateau
    grad_clip: float = 1.0  # clip the gradient norm to this; 0: no clipping
    class_weights: str = ""  # cross-entropy weight per class, e.g. 0.2,1,1; auto: from pixel counts
    focal_gamma: float = 0.0  # above 0: focal loss, (1 - p)^gamma x cross-entropy; 2 is usual
    dice_weight: float = 1.0  # x the soft Dice loss (of each mask's classes) beside it; 0: none
    best_metric: str = "miou"  # miou or dice: picks best.safetensors, early stops, plateau's lr
    seed: int = 0  # model init, data order and augmentation; same seed, same run
    log_every: int = 20  # optimizer steps between logged scalars; image panels at every eval
    # Predict, export and the data check: unet_predict.py, with settings of its own, which a
    # config.yaml of an earlier run may still hold (predict_dir, overlay); training skips them.
    SERVING_SETTINGS: ClassVar[dict] = dict.fromkeys(("predict_dir", "overlay"), SERVING.name)
    # Two of predict's settings are evaluation's too, of training and eval_only
    # (common/segmentation/inference.py):
    predict_tile: int = 0  # run the model on overlapping tiles of this size, blended; 0: whole
    predict_flip: bool = False  # average the logits of the image and its flips seen in training

    def validate(self):
        super().validate()
        require(
            self.scheduler in SCHEDULERS,
            f"scheduler must be {', '.join(SCHEDULERS)}, got {self.scheduler!r}",
        )
        check_settings(self, min_size=MIN_SIZE, multiple=PAD_MULTIPLE)  # unet_rules.py
        check_data_settings(self)  # unet_data.py


def read_trained(path):
    """What the weights file `path` records of its training (weights_record: these
    MODEL_SETTINGS, the classes, the input size, the flips), or None for a file that records
    none, such as a torch.save'd state_dict; --weights of training, and predict and export."""
    return read_weights_record(path, MODEL_SETTINGS)


# ADAPT: your augmentation of a training batch, where it is (the GPU if cached): uint8 images
# [N, C, H, W] and masks [N, H, W] alike. rand [N, RANDOMS]: per sample, seeded by (seed, epoch,
# sample); each transform takes its own columns. Pixels moved in from outside the image are
# IGNORE in the mask, and in the image its mirror image (fill reflect) or black (zeros). Copy-paste
# (copy_paste), which takes a second image, runs before, where the batch is read: see settle().
def augment(images, masks, rand, cfg):
    images, masks = crop_and_flip(
        images, masks, rand[:, :4], crop=cfg.crop_size, hflip=cfg.hflip, vflip=cfg.vflip
    )
    images, masks = zoom_and_rotate(
        images, masks, rand[:, 4:8], zoom=cfg.zoom, rotate=cfg.rotate, fill=cfg.fill
    )
    return colour_jitter(images, rand[:, 8:11], cfg.jitter), masks


# ADAPT: your loss. Ignored pixels (IGNORE: ignore_index, and the padding of bucket_by_size) must
# count for nothing.
def loss_per_image(logits, target, *, num_classes, weights=None, focal_gamma=0.0, dice_weight=1.0):
    """Cross-entropy (BCE for 1 class) + dice_weight x the soft Dice loss of the classes in the
    image's mask, per image, in fp32. weights: a weight per class for the cross-entropy
    (class_weights); focal_gamma: the focal loss of Lin et al., (1 - p)^gamma x cross-entropy,
    where p is the probability of the true class: pixels the model already gets right count
    less. A class absent from the mask adds no Dice term, as in segmentation_models.pytorch's
    DiceLoss: a Dice over every class pushes each absent class's probability down in every
    image (docs/unet.md, "Learning your classes")."""
    logits, valid = logits.float(), target != IGNORE
    pixels, target = valid.sum((1, 2)).clamp(min=1), target.clamp(min=0)
    if num_classes == 1:
        ce = F.binary_cross_entropy_with_logits(logits[:, 0], target.float(), reduction="none")
    else:
        ce = F.cross_entropy(logits, target, reduction="none")
    if focal_gamma:
        ce = ce * (1 - torch.exp(-ce)) ** focal_gamma  # exp(-ce) is p
    if weights is not None:
        ce = ce * weights[target]
    loss = (ce * valid).sum((1, 2)) / pixels
    if dice_weight:
        loss = loss + dice_weight * soft_dice_loss(logits, target, valid, num_classes)
    return loss


def compute_loss(logits, target, cfg, weights):
    """loss_per_image with the run's settings: what training and evaluation both call."""
    return loss_per_image(
        logits,
        target,
        num_classes=cfg.num_classes,
        weights=weights,
        focal_gamma=cfg.focal_gamma,
        dice_weight=cfg.dice_weight,
    )


def soft_dice_loss(logits, target, valid, num_classes):
    """Per image, the mean over the classes in its mask (its valid pixels) of 1 - soft Dice,
    (2 sum(p t) + 1) / (sum(p) + sum(t) + 1); 0 for an image with no valid pixel."""
    if num_classes == 1:  # the foreground's probability against its mask
        probs = logits[:, 0].sigmoid()
        inter, total, true = (
            (v * valid).sum((1, 2))[:, None]
            for v in (probs * target, probs + target, target.float())
        )
    else:
        inter, total, true = soft_dice_sums(logits.softmax(1), target, valid)
    dice = (2 * inter + 1) / (total + 1)  # +1: no 0 / 0
    present = (true > 0).float()  # the classes in the mask
    return ((1 - dice) * present).sum(1) / present.sum(1).clamp(min=1)


def soft_dice_sums(probs, target, valid):
    """Per image and class [N, C], over the valid pixels: sum(p * t), sum(p) + sum(t) and sum(t),
    where p is probs [N, C, H, W] and t the one-hot target. From the labels [N, H, W] by a
    gather and scatters, with no [N, C, H, W] one-hot: that costs passes over a tensor as large
    as the logits (docs/performance.md, "Many classes")."""
    n, c = probs.shape[:2]
    labels, valid = target.reshape(n, -1), valid.reshape(n, -1).to(probs.dtype)
    hit = probs.gather(1, target[:, None]).reshape(n, -1) * valid  # p of the true class
    inter = probs.new_zeros(n, c).scatter_add_(1, labels, hit)
    true = probs.new_zeros(n, c).scatter_add_(1, labels, valid)
    predicted = torch.bmm(probs.reshape(n, c, -1), valid[:, :, None])[..., 0]
    return inter, predicted + true, true


# ADAPT: your metric. Per image, the mean Dice of hard predictions over the classes but the
# background that its mask or its prediction holds (1 for an image with none: an absent class is
# no success), from each image's confusion matrix [N, C * C] (confusion_counts, where ignored
# pixels are in no cell). The IoU and Dice per class come from the summed matrix.
def image_dice(matrices, num_classes, background=0):
    hits, sizes = dice_counts(matrices, num_classes, background)
    present = sizes > 0
    dice = (2 * hits.double() / sizes.clamp(min=1) * present).sum(1) / present.sum(1).clamp(min=1)
    return torch.where(present.any(1), dice, 1.0)


def dice_counts(matrices, num_classes, background=0):
    """Per image and class but the background: |pred & true| and |pred| + |true|."""
    classes = value_count(num_classes)  # one sigmoid output: 2 classes
    matrices = matrices.view(-1, classes, classes)  # [image, true, predicted]
    hits, sizes = matrices.diagonal(dim1=1, dim2=2), matrices.sum(1) + matrices.sum(2)
    kept = dice_classes(num_classes, background)
    return hits[:, kept], sizes[:, kept]


def dice_classes(num_classes, background):
    """The classes whose Dice the `dice` figure averages: all but the background."""
    return [c for c in range(value_count(num_classes)) if c != background]


def train_one_epoch(
    model, loader, optimizer, *, scheduler, accelerator, cfg, progress, ema, classes, weights
):
    """One pass over this process's shard, or its rest after a resume. `progress` counts the
    batches and steps, says when to log, checkpoint and stop, and sums up the epoch. classes:
    what checkpoints record of them; weights: the loss's class weights (class_weights)."""
    model.train()
    progress.start_epoch(len(loader))
    main_process = accelerator.is_main_process
    for x, y, rand in tqdm(
        loader, f"epoch {progress.epoch}", disable=not main_process, leave=False
    ):
        with accelerator.accumulate(model):
            x, y = augment(x, y, rand, cfg)  # per sample, the same on any number of processes
            logits = model(prepare_input(x, cfg))
            loss = compute_loss(logits, y, cfg, weights).mean()
            accelerator.backward(progress.weighted(loss))  # a short last group weighs more
            if cfg.grad_clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        if not progress.after_batch(loss, len(y)):  # still accumulating
            continue
        if ema is not None:  # the moving average of the weights, once per optimizer step
            ema.update()
        # Stepped here, once per optimizer step: a prepared scheduler steps once per process.
        if cfg.scheduler in PER_STEP and not accelerator.optimizer_step_was_skipped:
            scheduler.step()
        if progress.log_due:
            accelerator.log(progress.train_scalars(optimizer), step=progress.step)
        if progress.checkpoint_due:  # every checkpoint_every_steps, and before stopping
            save(accelerator, cfg, progress=progress, scheduler=scheduler, classes=classes)
        if progress.stopping:  # max_steps, or Ctrl-C / SIGTERM on any rank
            break
    return progress.epoch_metrics()


@torch.inference_mode()
def evaluate(model, loader, accelerator, cfg, *, flips, weights, labels=None, background=0):
    """Over the validation images, each counted once on any number of processes
    (common/evaluation.py): `dice`, the mean of image_dice(), and from the confusion matrix of
    every pixel, the IoU and Dice of each class (keyed by `labels`, the class names; default: the
    class indices) and their mean, miou. flips: those to average over (flips_to_average);
    weights: the loss's class weights."""
    net = evaluation_model(model, accelerator, bucketed=cfg.bucket_by_size)
    sums = ExactSums(accelerator, bucketed=cfg.bucket_by_size)
    for x, y in loader:
        logits = segment(
            net, prepare_input(x, cfg), tile=cfg.predict_tile, flips=flips, multiple=PAD_MULTIPLE
        )
        loss = compute_loss(logits, y, cfg, weights)
        loss, matrices = sums.each_sample(loss, confusion_counts(logits, y, cfg.num_classes))
        sums.add(dice=image_dice(matrices, cfg.num_classes, background), loss=loss, pixels=matrices)
    totals = sums.totals()
    images, confusion = totals["samples"], totals["pixels"]
    iou, class_dice = class_scores(confusion, value_count(cfg.num_classes))
    labels = labels or [str(c) for c in range(len(iou))]
    return {
        "dice": totals["dice"] / images,
        "miou": sum(v for v in iou if v is not None) / max(sum(v is not None for v in iou), 1),
        "eval_loss": totals["loss"] / images,
        "eval_samples": images,
        "eval_pixels": int(confusion.sum()),  # those not ignored, each counted once
        "iou_per_class": dict(zip(labels, iou)),
        "dice_per_class": dict(zip(labels, class_dice)),
    }


def evaluate_with_average(model, ema, loader, accelerator, cfg, scoring):
    """evaluate() of the model, and with ema (ema_decay) of the weights' moving average too, as
    ema_miou, ema_dice, ...; scoring: evaluate()'s keyword arguments."""
    result = evaluate(model, loader, accelerator, cfg, **scoring)
    if ema is not None:
        averaged = evaluate(ema.synced(accelerator), loader, accelerator, cfg, **scoring)
        result.update({f"ema_{k}": v for k, v in averaged.items()})
    return result


@torch.inference_mode()
def first_panel(model, loader, accelerator, cfg, *, flips, colours):
    """image | prediction | truth of the first validation images, for the trackers: every process
    runs the first batch (a DDP model waits for all), the main process logs it."""
    x, y = next(iter(loader))
    net = evaluation_model(model, accelerator, bucketed=cfg.bucket_by_size)
    logits = segment(net, prepare_input(x, cfg), flips=flips, multiple=PAD_MULTIPLE)
    return image_panel(x, logits, y, cfg.num_classes, colours=colours)


def scalars(result):
    """The numbers of an evaluation result for a tracker: the per-class ones stay out."""
    return {k: v for k, v in result.items() if not isinstance(v, dict)}


def main(cfg):
    # 1. Runtime: processes and precision come from the accelerate config.
    if cfg.predict or cfg.export or cfg.check_data:  # from a --config file: the serving file's
        hand_over(SERVING)  # it runs in this process's place, with the same arguments
    accelerator = accelerator_for(cfg)  # build_accelerator() with the run's settings
    set_seed(cfg.seed)
    # No cudnn.benchmark with bucket_by_size: it would time every new (batch, height, width).
    set_deterministic(cfg.deterministic, benchmark=not cfg.bucket_by_size)
    out, checkpoint = open_run(accelerator, cfg)

    # 2. Data, and the settings settled once: each process checks a share of the masks, and a
    # bad one stops every rank alike; the data decides the classes and the input's channels.
    asked = cfg  # as given: the start-up notes say what auto became
    cfg, data, trained = settle(cfg, accelerator)
    weights = class_weights(cfg, data.class_pixels, accelerator.device)  # the loss's, or None
    trained_flips = "h" * (cfg.hflip > 0) + "v" * (cfg.vflip > 0)  # what predict_flip may flip
    flips = flips_to_average(cfg, trained["flips"] if trained and cfg.eval_only else trained_flips)
    train_loader, val_loader = data.train_loader, data.val_loader
    metrics = start_logging(accelerator, cfg, NAME, checkpoint=checkpoint)  # config.yaml too
    write_val_images(accelerator, val_loader.dataset.pairs, out / "val_images.csv")  # the split

    # 3. Model, optimizer and schedule.
    settings = {k: getattr(cfg, k) for k in MODEL_SETTINGS}
    model = build_model(settings, cfg)
    named = type(model).__name__  # as built: after prepare(), DDP may wrap it
    if getattr(cfg, "dropout", 0):  # the model's (unet_model.py); a model of your own may have none
        named += f" (dropout {cfg.dropout:g} in its two deepest levels)"
    load_weights(model, cfg.weights)  # --weights, if given
    model, norm = sync_batchnorm(model, accelerator, cfg.sync_bn)
    optimizer = make_optimizer(model, cfg.scaled_lr(accelerator.num_processes), cfg, accelerator)
    if cfg.bucket_by_size:  # bucketed loaders are sharded already: prepare() would deal them again
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, val_loader = accelerator.prepare(
            model, optimizer, train_loader, val_loader
        )
    ema = EMA.of(model, accelerator, cfg.ema_decay)  # the weights' moving average; None if 0
    scheduler = SCHEDULERS[cfg.scheduler](optimizer)
    adamw = f"{'fused ' * bool(optimizer.defaults['fused'])}AdamW lr {optimizer.defaults['lr']:g}"
    channels = "channels_last on" if cfg.channels_last else "channels_last off"
    channels += " (auto)" if asked.channels_last is None else ""
    accelerator.print(
        f"{NAME}: {describe(accelerator, data.batch, cfg.global_batch_size)}; "
        f"{MODES[cfg.in_channels]} images; {named}; {adamw}; {norm}; "
        f"{channels}; {data}; outputs to {out}/"
    )
    for note in start_up_notes(cfg, data, asked):
        accelerator.print(note)
    if note := busy_cores_note(accelerator):  # more torch threads than free CPU cores
        accelerator.print(note)

    # 4. Resume: weights, optimizer, every rank's RNG, the LR schedule and the place in the data.
    best = f"ema_{cfg.best_metric}" if ema else cfg.best_metric  # best.safetensors follows it
    progress = Progress(accelerator, cfg, metric=best)
    resume_or_start(  # and the LR schedule fitted to end where the run ends
        accelerator,
        checkpoint,
        cfg,
        progress=progress,
        scheduler=scheduler,
        batches_per_epoch=len(train_loader),
        recipe=NAME,
        data_order=DATA_ORDER,
        **same_classes(data.classes),
    )
    record = weights_record(data, model=settings, scale=cfg.scale, flips=trained_flips)
    stored = record_metadata(RECORD, record, recipe=NAME)  # in every weights file, for predict

    # 5. Train, evaluating after every epoch: the flips evaluate() averages, the loss's class
    # weights, the class names and the background that dice leaves out.
    scoring = {
        "flips": flips,
        "weights": weights,
        "labels": data.names,
        "background": data.background,
    }
    result = None
    while progress.epochs_left():
        catch_stop_signals()  # from here Ctrl-C and SIGTERM stop at a checkpoint, on every rank
        epoch, lr = progress.epoch, optimizer.param_groups[0]["lr"]
        train_loader.dataset.epoch = epoch  # new augmentations every epoch
        loader = progress.rest_of_epoch(train_loader)  # set_epoch; a resumed epoch skips its start
        train = train_one_epoch(
            model,
            loader,
            optimizer,
            scheduler=scheduler,
            accelerator=accelerator,
            cfg=cfg,
            progress=progress,
            ema=ema,
            classes=data.classes,
            weights=weights,
        )
        if progress.interrupted:
            break
        reset_peak_memory(accelerator.device)  # eval_peak_memory_mb: evaluation's own peak
        result = evaluate_with_average(model, ema, val_loader, accelerator, cfg, scoring)
        eval_peak = peak_memory_mb(accelerator.device)
        if progress.end_epoch(len(train_loader)):  # complete: max_steps can stop an epoch early
            if cfg.scheduler == "plateau":
                scheduler.step(result[cfg.best_metric])
            save_best(  # best.safetensors, if this is the best evaluation so far
                accelerator, progress, result, model=model, ema=ema, out=out, metadata=stored
            )
            save(accelerator, cfg, progress=progress, scheduler=scheduler, classes=data.classes)
        metrics.write(
            epoch=epoch, step=progress.step, lr=lr, **train, **result, eval_peak_memory_mb=eval_peak
        )
        accelerator.log({f"eval/{k}": v for k, v in scalars(result).items()}, step=progress.step)
        if accelerator.trackers:  # image | prediction | truth, logged by the main process
            panel = first_panel(
                model, val_loader, accelerator, cfg, flips=flips, colours=data.colours
            )
            for tracker_ in accelerator.trackers:
                tracker_.log_images(
                    {"eval/image_prediction_truth": panel.cpu()}, step=progress.step
                )
        accelerator.print(
            f"epoch {epoch}: train loss {train['train_loss']:.4f}, dice {result['dice']:.4f}, "
            f"miou {result['miou']:.4f} ({result['eval_samples']} images), "
            f"{train['train_samples_per_s']:.0f} images/s"
        )

    # 6. Finish: the final weights and metrics, or where to resume an interrupted run.
    if progress.why_stopped:  # Ctrl-C or SIGTERM (then nothing more), or early stopping
        accelerator.print(progress.why_stopped)
    if not progress.interrupted:
        if result is None:  # eval_only, or a resumed run that had nothing left to train
            result = evaluate_with_average(model, ema, val_loader, accelerator, cfg, scoring)
            metrics.write(
                epoch=None, step=progress.step, weights=str(cfg.weights or checkpoint), **result
            )
        if not cfg.eval_only:
            save_final(accelerator, model, ema, out, metadata=stored)  # and the moving average's
        accelerator.print(
            f"dice {result['dice']:.4f}, miou {result['miou']:.4f} on {result['eval_samples']} "
            f"validation images; outputs in {out}/"
        )
        if cfg.overfit_batches:  # the check's answer: can the model learn these batches?
            accelerator.print(overfit_verdict(result))

    # 7. Exit cleanly: drop what holds the process group, then close it.
    del model, optimizer, scheduler, train_loader, val_loader, data, ema
    close(accelerator)


# ---- What main() sets up: the data, the optimizer and checkpoints ----


def load_data(cfg, accelerator, trained=None):
    """The loaders, and what the data decides (classes, input size, channels): unet_data.py lists
    and reads the pairs, common/segmentation/data.py does the rest (the scan of every mask on
    all processes, decoding, augmentation's random numbers, bucketing). trained: the record of
    --weights, whose classes are the classes."""
    listed = from_main_process(accelerator, lambda: list_pairs(cfg))  # paired once per job
    train_pairs, val_pairs = (Pairs(split) for split in listed)
    if cfg.overfit_batches:  # can the model learn a few batches? Trained and evaluated on alike
        first = cfg.overfit_samples(accelerator.num_processes)
        train_pairs = val_pairs = FirstPairs(train_pairs, first)
    return load_segmentation(
        train_pairs,
        val_pairs,
        accelerator=accelerator,
        classes=mask_classes(cfg, trained),
        fixed="--mask_values" if cfg.mask_values else cfg.weights if trained else "",
        num_classes=cfg.num_classes,
        in_channels=input_channels(cfg),
        image_size=image_size(cfg, MIN_SIZE),
        scale=cfg.scale,
        bucket_by_size=cfg.bucket_by_size,
        max_batch_pixels=cfg.max_batch_pixels,
        cache_images=cfg.cache_images,
        cache_decoded=cfg.cache_decoded,
        batch_size=cfg.batch_size,
        eval_batch_size=cfg.eval_batch_size,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        crop_size=cfg.crop_size,
        pad_multiple=PAD_MULTIPLE,
        min_size=max(MIN_SIZE, cfg.crop_size),
        background=cfg.background,
        global_batch=cfg.global_batch_size,
    )


def settle(cfg, accelerator):
    """(cfg, data, trained): the settings this run trains with, settled here once, as main()
    trains and scripts/bench.py measures them (so that the two cannot drift apart), and the data
    they read. In order: this process count's share of global_batch_size (batch_size and
    accumulation steps), the model settings of --weights (trained: its record, or None), no
    augmentation and a constant lr for overfit_batches, then the data (load_data) and what it
    decides (resolved)."""
    cfg = cfg.split_global_batch(accelerator.num_processes)
    trained = read_trained(cfg.weights)  # --weights: its classes and model settings
    if trained:
        cfg = fit_to_record(
            cfg, trained["model"], MODEL_SETTINGS, path=cfg.weights, inferred=INFERRED
        )
    if cfg.overfit_batches:  # the first batches as they are, at a constant lr
        cfg = replace(cfg, **{k: v for k, v in OVERFIT.items() if hasattr(cfg, k)})
    data = load_data(cfg, accelerator, trained)
    cfg = resolved(cfg, data, accelerator.device)
    # Copy-paste: the dataset pastes the objects (every pixel not background) of another training
    # image, picked per sample, onto this share of them as it reads them (copy_paste() of
    # common/segmentation/augment.py, the same on any number of processes).
    data.train_loader.dataset.paste = (cfg.copy_paste, data.background)
    return cfg, data, trained


SCHEDULERS = {  # the cosines' length is set by fit_schedule(), at the start and on a resume
    "cosine": lambda optimizer: CosineAnnealingLR(optimizer, T_max=1),
    "hold_cosine": lambda optimizer: HeldCosine(optimizer, hold=0.7),
    "plateau": lambda optimizer: ReduceLROnPlateau(optimizer, "max", factor=0.1, patience=5),
    "constant": lambda optimizer: ConstantLR(optimizer, factor=1.0, total_iters=0),
}


PER_STEP = ("cosine", "hold_cosine")  # stepped every optimizer step; plateau at every evaluation


def make_optimizer(model, lr, cfg, accelerator):
    """AdamW with fused kernels where they work: one update for all the weights (fused_kernels)."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        weight_decay=cfg.weight_decay,
        fused=fused_kernels(accelerator),
    )


# The settings that fix each process's batches: a mid-epoch checkpoint resumes only with these.
DATA_ORDER = (
    "dataset",
    "images",
    "val_images",
    "train_list",
    "val_list",
    "train_split",
    "val_fraction",
    "seed",
    "batch_size",
    "gradient_accumulation_steps",
    "global_batch_size",
    "bucket_by_size",
    "max_batch_pixels",
    "scale",
    "overfit_batches",
)


def save(accelerator, cfg, *, progress, scheduler, classes):
    """A checkpoint: Accelerate's state, the position in the data, the LR schedule, DATA_ORDER,
    and the classes' mask values and those ignored, which a resume needs the same."""
    save_training(
        accelerator,
        cfg,
        progress=progress,
        scheduler=scheduler,
        recipe=NAME,
        data_order=DATA_ORDER,
        **same_classes(classes),
    )


def write_val_images(accelerator, pairs, path):
    """The pairs that the run evaluates on, a CSV row each (image, mask), so that another model
    can be trained and tested on the same split (val_fraction holds out a fixed share)."""
    mine = pairs.files() if accelerator.is_main_process else []  # every process has them all
    write_csv(accelerator, mine, path, header=["image", "mask"])  # a collective


def same_classes(classes):
    """What a checkpoint records of the classes, by the names of their settings."""
    return {
        "mask_values": list(classes.values),
        "ignore_index": list(classes.ignored),
        "ignore_unlisted": classes.unlisted_ignored,
    }


if __name__ == "__main__":
    run(main, Config, serving=SERVING)  # --predict, --export, --check_data: SERVING runs
