"""What the U-Net recipe decides from its settings and its data, apart from the training in
unet.py: the settings' checks, the auto rules (hflip, zoom, copy_paste, class_weights and the
rest that the data decides), what overfit_batches turns off, and the lines that the start-up
prints under its first (augmentation, dice, the data's notes) and the overfit check's verdict.

A copy may keep this file as it is, edit its rules, or replace it: unet.py imports check_settings,
image_size, resolved, class_weights, flips_to_average, OVERFIT, start_up_notes and
overfit_verdict from it, each of which a plain value or function can replace.
"""

from dataclasses import replace

import torch

from common.config import UserError, require, require_at_least
from common.segmentation.data import show_value, value_count


def check_settings(cfg, *, min_size, multiple):
    """The settings' ranges and the combinations that cannot work, each a one-line ConfigError:
    Config.validate() calls it. min_size, multiple: the model's smallest input side and the
    multiple its sides keep to (MIN_SIZE and PAD_MULTIPLE of the model file)."""
    require_at_least(cfg, 0, "weight_decay", "grad_clip", "max_batch_pixels", "dice_weight")
    require(
        (cfg.hflip is None or 0 <= cfg.hflip <= 1) and 0 <= cfg.vflip <= 1,
        "hflip and vflip are probabilities",
    )
    require(
        (cfg.zoom is None or cfg.zoom >= 0) and 0 <= cfg.rotate <= 180 and 0 <= cfg.jitter < 1,
        f"zoom must be 0 or more (0.25: 0.8 to 1.25 times), rotate 0 to 180 degrees and "
        f"jitter 0 to below 1; got {cfg.zoom}, {cfg.rotate} and {cfg.jitter}",
    )
    require(
        cfg.copy_paste is None or 0 <= cfg.copy_paste <= 1,
        f"copy_paste is the share of training images that get another's objects, 0 to 1; got "
        f"{cfg.copy_paste}",
    )
    require(
        not (cfg.bucket_by_size and cfg.copy_paste),
        "copy_paste pastes between images of one size: set --image_size, not bucket_by_size "
        "(or --copy_paste 0)",
    )
    require(
        cfg.fill in ("reflect", "zeros"),
        f"fill must be reflect (the image mirrored past its edges) or zeros, got {cfg.fill!r}",
    )
    size = image_size(cfg, min_size)
    require(
        cfg.crop_size == 0 or cfg.crop_size >= min_size,
        f"crop_size must be 0 or at least {min_size}: the U-Net halves the image 4 times",
    )
    require(not size or cfg.crop_size <= min(size), "crop_size cannot exceed image_size's sides")
    require(cfg.scale >= 0, f"scale must be above 0 (or 0: no resize), got {cfg.scale}")
    require(not (size and cfg.scale), "choose one of image_size and scale")
    require(
        not cfg.bucket_by_size or not (size or cfg.crop_size),
        "bucket_by_size trains on the images' own sizes: leave image_size, crop_size at 0",
    )
    require(
        not (cfg.global_batch_size and cfg.max_batch_pixels),
        "global_batch_size counts images, max_batch_pixels pixels: set one (batch_size caps "
        "the images of a process's batch)",
    )
    require(
        cfg.best_metric in ("miou", "dice"),
        f"best_metric must be miou or dice, got {cfg.best_metric!r}",
    )
    require(cfg.focal_gamma >= 0, f"focal_gamma must be 0 or more, got {cfg.focal_gamma}")
    if cfg.class_weights and cfg.class_weights != "auto":
        listed_weights(cfg.class_weights)
    require(
        not cfg.predict_flip or cfg.eval_only or cfg.predict or cfg.hflip != 0 or cfg.vflip,
        "predict_flip averages over the flips of training: set hflip or vflip above 0",
    )
    tile = cfg.predict_tile
    require(
        tile == 0 or (tile >= min_size and tile % multiple == 0),
        f"predict_tile must be 0 or a multiple of {multiple} from {min_size} up (the "
        f"U-Net halves a tile 4 times), got {tile}",
    )
    require(
        cfg.predict or not str(cfg.weights).endswith(".onnx"),
        "an .onnx file only predicts: train or evaluate from the .safetensors it was made from",
    )


def image_size(cfg, min_size):
    """image_size as (height, width): "512" is (512, 512), "640x960" (640, 960); None if empty.
    min_size: the model's smallest side (MIN_SIZE)."""
    text = str(cfg.image_size).strip().lower()
    if text in ("", "0"):
        return None
    try:
        height, width = (int(v) for v in text.split("x")) if "x" in text else (int(text),) * 2
    except ValueError:
        height = width = 0
    require(
        min(height, width) >= min_size,
        f"image_size must be SIZE or HxW (height x width), each at least {min_size} (the U-Net "
        f"halves the image 4 times), like 512 or 640x960; got {cfg.image_size!r}",
    )
    return height, width


# overfit_batches: what augment() reads, each at its value that turns it off, the lr held
# constant (a schedule fitted to a short run lowers it before the batches are learned), and the
# model's dropout off (unet_model.py; a model of your own may have none).
OVERFIT = {
    "crop_size": 0,
    "hflip": 0.0,
    "vflip": 0.0,
    "zoom": 0.0,
    "rotate": 0.0,
    "jitter": 0.0,
    "copy_paste": 0.0,
    "scheduler": "constant",
    "dropout": 0.0,
}


def listed_weights(text):
    """--class_weights 0.2,1,1 as [0.2, 1.0, 1.0], or a ConfigError."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        weights = []
    require(
        weights and min(weights) >= 0 and max(weights) > 0,
        f"class_weights must be auto or a non-negative weight per class, like 0.2,1,1; got "
        f"{text!r}",
    )
    return weights


def class_weights(cfg, class_pixels, device):
    """The cross-entropy's weight per class as a tensor on `device`, or None: --class_weights as
    listed, or
    auto: ENet's 1 / ln(1.02 + share) of each class's share of the training pixels (a rare class
    weighs up to 50 times a common one, not the thousands that 1 / share can reach), scaled so
    that the average training pixel weighs 1, as without weights."""
    if not cfg.class_weights:
        return None
    count = value_count(cfg.num_classes)
    if cfg.class_weights != "auto":
        weights = listed_weights(cfg.class_weights)
        if len(weights) != count:
            raise UserError(
                f"class_weights lists {len(weights)} weights for {count} classes: give one per "
                f"class, or auto"
            )
        return torch.tensor(weights, device=device)
    share = torch.tensor(class_pixels, dtype=torch.float64) / max(sum(class_pixels), 1)
    weights = 1 / torch.log(1.02 + share)
    return (weights / (weights * share).sum()).float().to(device)


def resolved(cfg, data, device):
    """cfg with what the data and the device decide. The data (load_data)
    decides num_classes, in_channels, max_batch_pixels, cache_images and eval_batch_size (0: by
    pixels), hflip auto: 0 where classes are mirror twins (left/right) or shapes that a mirror
    changes (digits, letters), else 0.5, and zoom auto: 0.25 for such shapes, which it leaves
    alike (a zoomed digit is the same digit), in the flips' place, else 0; copy_paste auto:
    0.5 for objects on a background (on_a_background), else 0, and 0 with bucket_by_size (the
    images differ in size); channels_last auto is on with CUDA, off on CPUs
    (docs/performance.md)."""
    auto = cfg.channels_last is None
    cfg = replace(
        cfg,
        hflip=(0.0 if data.twins or data.mirrored else 0.5) if cfg.hflip is None else cfg.hflip,
        zoom=(0.25 if data.mirrored else 0.0) if cfg.zoom is None else cfg.zoom,
        copy_paste=(
            (0.5 if on_a_background(data) and not cfg.bucket_by_size else 0.0)
            if cfg.copy_paste is None
            else cfg.copy_paste
        ),
        num_classes=data.num_classes,
        in_channels=data.in_channels,
        max_batch_pixels=data.max_batch_pixels,
        cache_images=data.cached,
        eval_batch_size=data.eval_batch_size,
        channels_last=device.type == "cuda" if auto else cfg.channels_last,
    )
    return cfg


def on_a_background(data):
    """copy_paste auto's test: the classes are objects on a background, which holds half the
    training pixels or more (digits, VOC's objects, Carvana's cars: another image's objects can
    lie on it), with no mirror twins (an atlas's regions, each where it belongs). Where the
    class of the most pixels holds less (a street's road, among buildings, sky and cars), the
    other classes fill most of an image, and pasting them would replace it."""
    pixels = data.class_pixels
    return not data.twins and 2 * pixels[data.background] >= sum(pixels)


def flips_to_average(cfg, trained):
    """predict_flip: the flips of training ("h", "v", both) that segment() averages over; else
    none. `trained`: those of this run's settings, or of the weights file it evaluates."""
    if not cfg.predict_flip:
        return ""
    if not trained:
        raise UserError(
            "predict_flip averages over the flips of training, and this model was trained with "
            "none (hflip and vflip 0): leave predict_flip off"
        )
    return trained


DOMINANT = 0.9  # the share of pixels above which one class is said to dominate


RARE_CLASSES = "recipes/configs/rare_classes.yaml"  # the settings that learned rare classes


def imbalance_note(cfg, data):
    """A start-up line when one class holds most of the training pixels and neither class_weights
    nor focal_gamma is set: the model may then learn that class alone, which Dice hides, and a
    class of a few pixels may never be learned, even on one batch. It names the settings that
    learned such classes (docs/unet.md, "Learning your classes"), for a run that ends so: on
    classes told apart by shape, runs stay close to the background alone for their first epochs
    and then learn, and the class weights cost mIoU there (docs/learning.md)."""
    pixels = data.class_pixels
    top = max(range(len(pixels)), key=pixels.__getitem__)
    share = pixels[top] / max(sum(pixels), 1)
    if share <= DOMINANT or cfg.class_weights or cfg.focal_gamma:
        return None
    value = show_value(data.values[top], data.classes.colour)
    name = f"{data.names[top]}, " if data.classes.names else ""
    present = sum(p > 0 for p in pixels)  # a class in no mask is left out of miou's mean
    return (
        f"note: class {top} ({name}mask value {value}) holds {share:.0%} of the training pixels: "
        f"if a run ends with the model predicting it alone (its IoU near {share:.2f}, the other "
        f"classes' 0: miou near {share / present:.2f}), set --class_weights auto, or --config "
        f"{RARE_CLASSES}; --overfit_batches 1 checks that it can learn one batch"
    )


OVERFIT_IOU = 0.8  # overfit_batches: a class of the batches is learned at this IoU or more


def overfit_verdict(result):
    """The last line of an overfit_batches run: whether every class of the batches it trained and
    evaluated on reached OVERFIT_IOU, and which did not."""
    iou = {name: v for name, v in result["iou_per_class"].items() if v is not None}
    low = {name: v for name, v in iou.items() if v < OVERFIT_IOU}
    if not low:
        return (
            f"overfit check passed: every class of these batches at IoU {OVERFIT_IOU} or more "
            f"(lowest {min(iou.values()):.2f})"
        )
    shown = ", ".join(f"{name} {v:.2f}" for name, v in sorted(low.items(), key=lambda x: x[1]))
    return (
        f"overfit check failed: {len(low)} of {len(iou)} classes below IoU {OVERFIT_IOU} "
        f"({shown}): train longer (--epochs) or at a higher --lr, then see docs/unet.md, "
        f"Learning your classes"
    )


def start_up_notes(cfg, data, asked):
    """The lines under the start-up line (and the data check's): what augmentation runs, what
    dice averages, what the data suggests (a void label, mirror twins), a dominant class. asked:
    the settings as given, whose auto the notes explain."""
    notes = [augmentation_note(cfg), dice_note(cfg, data), *data.notes]
    notes += [twins_note(data, asked.hflip), mirrored_note(data, asked)]
    notes += [imbalance_note(cfg, data)]
    return [note for note in notes if note]


def twins_note(data, hflip):
    """A start-up line when classes are mirror twins (a left region and its right one: the data's
    twins); hflip: the setting as given (None: auto, which is 0 when there are twins)."""
    if not data.twins:
        return None
    twins, labels = data.twins, data.names
    shown = ", ".join(f"{labels[i]}/{labels[j]}" for i, j in twins[:6])
    more = f" ... ({len(twins)} pairs)" if len(twins) > 6 else ""
    then = (
        "hflip is 0 (auto; --hflip 0.5 flips anyway)"
        if hflip is None
        else f"--hflip {hflip:g} turns one into the other in training: leave hflip at auto"
        if hflip
        else "hflip 0 keeps them apart"
    )
    return (
        f"note: classes {shown}{more} are mirror twins, each where the other's mirror image is "
        f"(left and right): {then}"
    )


def mirrored_note(data, asked):
    """A start-up line when the classes' shapes are ones that a mirror changes, as digits' and
    letters' are (the data's mirrored, mirror_shapes). asked: the settings as given, whose hflip
    and zoom auto (None) are then 0 and 0.25."""
    if not data.mirrored:
        return None
    labels, apart, hflip = data.names, [d for _, d in data.mirrored], asked.hflip
    shown = ", ".join(labels[i] for i, _ in data.mirrored[:8])
    more = f" ... ({len(data.mirrored)} classes)" if len(data.mirrored) > 8 else ""
    then = (
        "hflip is 0 (auto; --hflip 0.5 flips anyway)"
        if hflip is None
        else f"--hflip {hflip:g} trains on mirror images that these classes do not come in: "
        f"leave hflip at auto"
        if hflip
        else "hflip 0 keeps them as they come"
    )
    if asked.zoom is None:
        then += ", and zoom is 0.25 in the flips' place (auto; --zoom 0 turns it off)"
    return (
        f"note: classes {shown}{more} have shapes that a mirror changes, as digits and letters "
        f"do (their mean shape and its mirror image differ by {min(apart):.2f} to "
        f"{max(apart):.2f} of its area): {then}"
    )


# augmentation_note: what each fill puts past the image's edges where zoom or rotate move it.
FILLS = {"reflect": "mirrored (--fill zeros: black)", "zeros": "black (--fill reflect: mirrored)"}


def augmentation_note(cfg):
    """The start-up line that says what augmentation training runs (augment()), each setting at
    its value: 0 turns it off."""
    running = [
        f"{name} {getattr(cfg, name):g}"
        for name in ("hflip", "vflip", "zoom", "rotate", "jitter", "crop_size", "copy_paste")
        if getattr(cfg, name)
    ]
    if not running:
        return (
            "augmentation: none (hflip, vflip, zoom, rotate, jitter, crop_size and copy_paste "
            "all 0)"
        )
    note = f"augmentation: {', '.join(running)} (each off at 0)"
    if cfg.zoom or cfg.rotate:
        note += f"; past the image's edges: {FILLS[cfg.fill]}"
    return note


def dice_note(cfg, data):
    """The start-up line that says which classes `dice` averages: all but the background, the
    class of the most training pixels unless --background names one."""
    covered = [name for c, name in enumerate(data.names) if c != data.background]
    why = "as --background says" if cfg.background else "the most pixels; --background changes it"
    more = f" ... ({len(covered)} in all)" if len(covered) > 12 else ""
    return (
        f"dice: per image, the mean over those of classes {', '.join(covered[:12])}{more} in "
        f"its mask or prediction; background: {data.names[data.background]} ({why})"
    )
