"""Segmentation machinery that a U-Net recipe uses as it is: image and mask pairs, mask values,
loaders (plain or bucketed by size), the Dice counts, the settings stored in a weights file,
and predict. A recipe keeps what a user adapts: the model, the augmentation and the loss.

    weights = SegmentationWeights.read(cfg.weights) if cfg.weights else None
    data = load_data(cfg, accelerator, augment, weights)  # augment(images, masks, rand): training batches
    data.train_loader, data.val_loader, data.values, data.num_classes, data.input_size

Data comes as a folder with imgs/ and masks/ (the Carvana layout: imgs/NAME.jpg with
masks/NAME.png or masks/NAME_mask.gif), or as anything datasets.load_dataset reads, with an
image and a mask column. A mask holds one grey level or palette index per class; class i is
mask value values[i].
"""

import dataclasses
import glob
import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from PIL import Image
from safetensors import SafetensorError, safe_open
from torch.utils.data import DataLoader, Dataset

from common.checkpoint import load_weights
from common.config import RunConfig, UserError, require, require_at_least
from common.data import IMAGE_ERRORS, DataError, load_splits, require_one_batch_per_process, unreadable_image
from common.export import OnnxModel, onnx_metadata
from common.runtime import ignore_stop_signals
from common.sampler import bucket_loader

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp"}
IGNORE = -1  # the class of padded pixels: no loss, no Dice
PAD_MULTIPLE = 16  # bucketed batches are padded to a multiple of 16: the U-Net halves 4 times
SHAPES = "data/shapes"  # the U-Net's default data, made by `make data/shapes`
RANDOMS = 8  # uniform random numbers per training sample that an augmentation gets (rand[n])
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # input channels -> the PIL mode images are read in
CACHE_BUDGET_GB = 4  # cache_images auto: decode once if images and masks take at most this per process


@dataclass
class SegmentationConfig(RunConfig):
    """The settings that load_data() and predict() read, beside a recipe's own: the layout of
    the data, the classes, bucketing by size, and predict's files."""

    val_fraction: float = 0.1  # imgs/ + masks/: share held out for validation, fixed for every seed
    image_column: str = "image"  # datasets data: the column of images
    mask_column: str = "mask"  # datasets data: the column of masks
    train_split: str = "train"  # datasets data
    val_split: str = "validation"  # datasets data
    mask_values: str = ""  # mask values in class order, e.g. "0,255"; empty: the sorted values found
    num_classes: int = 0  # with background; 0: one per mask value; 1: a sigmoid, for 2 values
    in_channels: int = 0  # of the model's input: 1 grey, 3 RGB, 4 RGBA; 0: the images' own
    # Images of different sizes: train and evaluate each at its own size, in similar-size batches.
    bucket_by_size: bool = False  # batches padded to their largest image; loss and Dice skip padding
    max_batch_pixels: int = 0  # bucket_by_size: padded pixels per batch; 0: batch_size x largest
    # Decoding: once at start-up, into memory (a GPU's with CUDA), or at every read in DataLoader workers.
    cache_images: str = "auto"  # true, false, or auto: decode once if images + masks take at most 4 GiB
    # Predict: write masks for new images with `weights`, whose file holds the model settings.
    predict: Optional[str] = None  # an image file or glob
    predict_dir: Optional[str] = None  # where the NAME_mask.png go; default output_dir/predictions
    overlay: bool = False  # also write NAME_overlay.png, the image with the classes painted on
    # Predict and eval_only (and the evaluation of a training run): see segment().
    predict_tile: int = 0  # run the model on overlapping tiles of this size, blended; 0: whole images
    predict_flip: bool = False  # average the logits of the image and its flips seen in training

    def validate(self):
        super().validate()
        require_at_least(self, 0, "num_classes", "max_batch_pixels")
        require(self.in_channels in (0, *MODES), f"in_channels must be 0 (from the images), 1, 2, 3 or 4, "
                                                 f"got {self.in_channels}")
        require(self.cache_images in ("auto", "true", "false"),
                f"cache_images must be auto, true or false, got {self.cache_images!r}")
        require(0 < self.val_fraction < 1, f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        if self.mask_values:
            count = value_count(self.num_classes) if self.num_classes else None
            given = parse_values(self.mask_values, "--mask_values")
            require(count in (None, len(given)), f"mask_values needs one value per class ({count} for "
                                                 f"num_classes {self.num_classes}), got {self.mask_values!r}")
        require(not self.predict or self.weights, "predict needs weights: add --weights PATH/model.safetensors")
        require(self.predict_tile == 0 or (self.predict_tile >= 32 and self.predict_tile % PAD_MULTIPLE == 0),
                f"predict_tile must be 0 or a multiple of 16 from 32 up (the U-Net halves a tile 4 times), "
                f"got {self.predict_tile}")
        require(not (self.predict and self.eval_only), "choose one of predict and eval_only")
        require(not (self.predict and self.export), "choose one of predict and export")
        require(self.predict or not str(self.weights).endswith(".onnx"),
                "an .onnx file only predicts: train or evaluate from the .safetensors it was made from")


def parse_values(text, where):
    """'0,85,170' -> [0, 85, 170]: distinct non-negative integers, or a ConfigError."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    require(values and min(values) >= 0 and len(set(values)) == len(values),
            f"{where} must be distinct non-negative integers separated by commas, like 0,255; got {text!r}")
    return values


def value_count(num_classes):
    """How many mask values a model tells apart: a 1-class (sigmoid) model has background and foreground."""
    return 2 if num_classes == 1 else num_classes


def folder_pairs(root):
    """[(image path, mask path, name)] for imgs/NAME.* with masks/NAME.* or masks/NAME_mask.*, by name."""
    def files(folder):
        return {p.stem: p for p in sorted((root / folder).iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES}

    masks, pairs = files("masks"), []
    for stem, image in files("imgs").items():
        found = [masks[s] for s in (stem, stem + "_mask") if s in masks]
        if len(found) != 1:
            raise DataError(f"{image} has {'two masks' if found else 'no mask'}: expected one of "
                            f"masks/{stem}.png or masks/{stem}_mask.png (any image type)")
        pairs.append((image, found[0], str(found[0])))
    if not pairs:
        raise DataError(f"{root / 'imgs'} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return pairs


class TableRows:
    """The (image, mask, name) rows of a datasets.Dataset, decoded when read."""

    def __init__(self, ds, cfg, split):
        self.ds, self.columns, self.where = ds, (cfg.image_column, cfg.mask_column), f"{cfg.dataset} {split}"

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        try:
            row = self.ds[i]  # decodes the image and the mask
        except IMAGE_ERRORS as e:
            raise unreadable_image(f"{self.where} row {i}", e, "image or mask") from None
        return row[self.columns[0]], row[self.columns[1]], f"{self.where} row {i}"


def open_sources(cfg):
    """The train and validation sources, from imgs/ + masks/ or from datasets. A source is a
    sequence of (image, mask, name); the name is for messages."""
    root = Path(cfg.dataset)
    if cfg.dataset == SHAPES and not root.exists():
        raise DataError(f"{root} does not exist yet: write it with `make data/shapes` or python scripts/make_shapes.py")
    if (root / "imgs").is_dir() and not (root / "masks").is_dir():
        raise DataError(f"{root} has imgs/ but no masks/: add masks/NAME.png or masks/NAME_mask.* for each imgs/NAME.*")
    if (root / "imgs").is_dir():
        pairs = folder_pairs(root)
        n_val = int(len(pairs) * cfg.val_fraction)
        if not 0 < n_val < len(pairs):
            raise DataError(f"val_fraction {cfg.val_fraction} of {len(pairs)} images leaves none to validate or train")
        # A fixed generator, as in milesial/Pytorch-UNet: the held-out images do not move with --seed.
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
        return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]
    hint = (f"use a folder with imgs/ and masks/ (masks/NAME.png or masks/NAME_mask.* for each imgs/NAME.*), "
            f"or parquet files {cfg.train_split}*.parquet and {cfg.val_split}*.parquet with columns "
            f"{cfg.image_column} and {cfg.mask_column}")
    splits = load_splits(cfg.dataset, [cfg.train_split, cfg.val_split], [cfg.image_column, cfg.mask_column], hint)
    return [TableRows(splits[split], cfg, split) for split in (cfg.train_split, cfg.val_split)]


def open_image(path, kind="image"):
    """Image.open(path): the header is read, the pixels when first used. A DataError naming the
    file if PIL cannot open it."""
    try:
        return Image.open(path)
    except IMAGE_ERRORS as e:
        raise unreadable_image(path, e, kind) from None


def read_pair(image, mask, name):
    """A PIL image and its mask as an integer array of pixel values (grey levels or palette indices).

    Files are opened, and the mask decoded: a file PIL cannot read stops with a DataError naming
    it. The image's pixels are decoded when used (decode_pair), so a scan reads only its header."""
    image, mask = (open_image(p, kind) if isinstance(p, Path) else p for p, kind in ((image, "image"), (mask, "mask")))
    if not isinstance(mask, Image.Image):
        raise DataError(f"{name}: the mask is a {type(mask).__name__}, not an image: check mask_column")
    try:
        values = np.asarray(mask.convert("L") if mask.mode == "1" else mask)
    except IMAGE_ERRORS as e:  # a truncated or broken mask file
        raise unreadable_image(name, e, "mask") from None
    if values.ndim == 3:  # a grey mask saved as RGB(A): keep one channel if the others agree
        if not (values[..., :3] == values[..., :1]).all():
            raise DataError(f"mask {name} is in colour: save one grey level or palette index per class")
        values = values[..., 0]
    if image.size != values.shape[::-1]:
        raise DataError(f"mask {name} is {values.shape[1]}x{values.shape[0]}, its image {image.width}x{image.height}")
    return image, values.astype(np.int64)


def scan_masks(accelerator, sources):
    """{mask value: [number of masks holding it, one of them]}, per source the (height, width)
    of each image, in order, and {image mode: an image of that mode}.

    Each process reads its share of the pairs and the results are gathered, so a bad file stops
    every rank with the same one-line error (never one rank raising while the others wait).
    """
    found, sizes, modes, problems = {}, {}, {}, []
    items = [(s, i) for s, source in enumerate(sources) for i in range(len(source))]
    for s, i in items[accelerator.process_index :: accelerator.num_processes]:
        try:
            path, mask, name = sources[s][i]
            image, values = read_pair(path, mask, name)
        except (DataError, OSError, Image.DecompressionBombError) as e:  # OSError: a file PIL cannot read
            problems.append(str(e))
            continue
        sizes[s, i] = values.shape
        modes.setdefault(image.mode, str(path) if isinstance(path, Path) else name)
        for v in np.unique(values).tolist():
            found.setdefault(v, [0, name])[0] += 1
    merged, all_sizes, all_modes = {}, {}, {}
    for rank_found, rank_sizes, rank_modes, rank_problems in gather_object([(found, sizes, modes, problems)]):
        if rank_problems:
            raise DataError(rank_problems[0])
        all_sizes.update(rank_sizes)
        all_modes = {**rank_modes, **all_modes}
        for v, (count, name) in rank_found.items():
            merged.setdefault(v, [0, name])[0] += count
    sizes = [[all_sizes[s, i] for i in range(len(source))] for s, source in enumerate(sources)]
    return merged, sizes, all_modes


def channels_of_data(cfg, modes, input_channels):
    """The model's input channels: cfg.in_channels (the setting or the weights'), else what
    input_channels(mode) says of the images' modes, which must agree."""
    if cfg.in_channels:
        return cfg.in_channels
    seen = {}
    for mode, name in sorted(modes.items()):
        seen.setdefault(input_channels(mode), (mode, name))
    if len(seen) > 1:
        (few, (mode1, name1)), (many, (mode2, name2)) = sorted(seen.items())[:2]
        raise DataError(f"images have different channels: {name1} is {mode1} ({few}), {name2} is {mode2} "
                        f"({many}): convert them to one mode, or set --in_channels {many} to read all as "
                        f"{MODES[many]}")
    return next(iter(seen))


def classes_and_size(cfg, found, sizes, weights):
    """(mask values in class order, num_classes, input size (h, w) or None for each its own).

    The values come from --mask_values, else the weights file, else the sorted values found;
    num_classes from the setting, else the number of values."""
    text = cfg.mask_values
    values = parse_values(text, "mask_values") if text else weights.mask_values if weights else sorted(found)
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise DataError(f"mask {found[unknown[0]][1]} has value {unknown[0]}, which is not one of mask_values "
                        f"{','.join(map(str, values))}: fix the mask, or list the value in --mask_values")
    if len(values) < 2:
        raise DataError(f"every mask holds only the value {values[0]}: a model needs a background and "
                        f"at least one class; check the masks, or set --mask_values")
    num_classes = cfg.num_classes or len(values)
    if len(values) != value_count(num_classes) and (text or weights):
        raise DataError(f"{'--mask_values' if text else cfg.weights} gives {len(values)} mask values, which "
                        f"does not fit num_classes {num_classes}: set --num_classes")
    shown, rare = ",".join(map(str, values[:8])), min(values, key=lambda v: found.get(v, [0])[0])
    if len(values) != value_count(num_classes):
        raise DataError(f"the masks hold {len(values)} values ({shown}) where num_classes "
                        f"{num_classes} expects {value_count(num_classes)}; the rarest, {rare}, is in "
                        f"{found[rare][0]} mask(s), such as {found[rare][1]}: fix the masks, set --num_classes, or "
                        f"set --mask_values to the values that are classes")
    masks = sum(len(source_sizes) for source_sizes in sizes)
    if not (cfg.num_classes or text or weights) and (len(values) > 32 or (found[rare][0] == 1 and masks >= 20)):
        # Inferred classes: a value in a single mask, or dozens of values (antialiased or JPEG
        # masks), is more likely a broken mask than a class.
        raise DataError(f"the masks hold {len(values)} values ({shown}); the rarest, {rare}, is in "
                        f"{found[rare][0]} of {masks} masks, such as {found[rare][1]}: fix the masks, set "
                        f"--mask_values to the values that are classes, or --num_classes {len(values)} to keep them all")
    if cfg.image_size:
        return values, num_classes, (cfg.image_size, cfg.image_size)
    if cfg.bucket_by_size:
        return values, num_classes, None  # every image keeps its own size
    distinct = sorted({size for source_sizes in sizes for size in source_sizes})
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[:2]
        raise DataError(f"images have different sizes ({w1}x{h1}, {w2}x{h2}): set --image_size to resize them, "
                        f"or --bucket_by_size true to train on each at its own size")
    ((h, w),) = distinct
    if min(w, h) < max(32, cfg.crop_size):
        raise DataError(f"images are {w}x{h}, smaller than crop_size or the U-Net's 32 pixels: set --image_size")
    return values, num_classes, (h, w)


class SegmentationSet(Dataset):
    """Whole batches, read a batch at a time (`__getitems__`): uint8 images [N, C, H, W] and int64
    class indices [N, H, W], then `augment(images, masks, rand)` if given (training).

    The images come decoded from `cache` (decode_all, on any device: a batch is gathered there
    and augmented there), or else are decoded from `source` at every read, in DataLoader
    workers. `pad`: images of different sizes, padded per batch (pad_collate).

    rand[n] holds RANDOMS uniform numbers for the n-th sample of the batch, drawn from a
    generator seeded with (seed, epoch, sample index): the same augmentation whatever the
    number of workers or processes, cached or not, and after a resume. The recipe sets `epoch`
    before each epoch. It lives in shared memory, so persistent DataLoader workers (started
    once, not every epoch) see the new value too.
    """

    def __init__(self, source, values, mode, size, seed, augment=None, cache=None, pad=False):
        self.source, self.values, self.mode, self.size, self.seed = source, values, mode, size, seed
        self.augment, self.cache, self.pad = augment, cache, pad
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self):
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value):
        self._epoch.fill_(value)

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        images, masks = self.__getitems__([i])
        return images[0], masks[0]

    def __getitems__(self, indices):
        if self.cache is None:
            pairs = [decode_pair(self.source, i, self.values, self.mode, self.size) for i in indices]
        elif self.pad:  # a list of images of their own sizes
            pairs = [(self.cache[0][i], self.cache[1][i]) for i in indices]
        else:  # one gather per tensor, where the cache is
            index = to_device(torch.as_tensor(indices), self.cache[0].device)
            images, masks = self.cache[0].index_select(0, index), self.cache[1].index_select(0, index).long()
        if self.cache is None or self.pad:
            pairs = [(image, mask.long()) for image, mask in pairs]
            images, masks = pad_collate(pairs) if self.pad else (torch.stack(t) for t in zip(*pairs))
        if self.augment is None:
            return images, masks
        return self.augment(images, masks, self.randoms(indices))

    def randoms(self, indices):
        """[len(indices), RANDOMS] uniform numbers in [0, 1), each row from its sample's seed."""
        gen, base = torch.Generator(), (self.seed * 1_000_003 + self.epoch) * 1_000_003
        return torch.stack([torch.rand(RANDOMS, generator=gen.manual_seed(base + i)) for i in indices])


def to_device(tensor, device):
    """A CPU tensor on `device`; to a GPU from pinned memory, so that the copy does not wait for
    the GPU's queued work."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def crop_and_flip(images, masks, rand, crop=0, hflip=0.0, vflip=0.0):
    """The same crop and flips for each image of a batch and its mask, per sample, on the batch's
    device: a crop x crop window at a random place (rand[n, 0] and rand[n, 1]; crop 0: the
    whole image), flipped left to right if rand[n, 2] < hflip and upside down if rand[n, 3] <
    vflip. images [N, C, H, W], masks [N, H, W]. The windows are views; one copy stacks them."""
    if not (crop or hflip or vflip):
        return images, masks
    height, width = images.shape[-2:]
    h, w = crop or height, crop or width
    out = []
    for image, mask, (row, col, left_right, up_down, *_) in zip(images, masks, rand.tolist()):
        top, left = min(int(row * (height - h + 1)), height - h), min(int(col * (width - w + 1)), width - w)
        image, mask = image[:, top : top + h, left : left + w], mask[top : top + h, left : left + w]
        flips = [dim for dim, p, u in ((-1, hflip, left_right), (-2, vflip, up_down)) if u < p]
        out.append((image.flip(flips), mask.flip(flips)) if flips else (image, mask))
    return torch.stack([image for image, _ in out]), torch.stack([mask for _, mask in out])


def decode_pair(source, i, values, mode, size=None):
    """Sample i of `source` as uint8 tensors: the image in PIL `mode` [C, H, W] and its class indices
    [H, W] (int64 for more than 256 classes), resized to `size` (height, width) if given: the
    image antialiased, the mask by nearest neighbour. A DataError names a file that fails."""
    # Imported here, not at the top: torchvision loads torch's compiler, over 1 s that --help and
    # the checks before any image is decoded need not wait.
    from torchvision.transforms.v2.functional import InterpolationMode, pil_to_tensor, resize

    path, mask, name = source[i]  # a table row is decoded here, once
    image, mask_values = read_pair(path, mask, name)
    try:
        image = image.convert(mode)  # decodes an image file: scan_masks read only its header
    except IMAGE_ERRORS as e:  # such as a truncated file
        raise unreadable_image(path if isinstance(path, Path) else name, e) from None
    lut = np.zeros(max(max(values), int(mask_values.max())) + 1, np.uint8 if len(values) <= 256 else np.int64)
    lut[values] = np.arange(len(values))  # scan_masks made sure that no other value occurs
    image, classes = pil_to_tensor(image), torch.from_numpy(lut[mask_values])
    if size is not None and tuple(classes.shape) != tuple(size):
        image = resize(image, list(size), antialias=True)
        classes = resize(classes[None], list(size), InterpolationMode.NEAREST)[0]
    return image, classes


def decode_all(source, values, mode, size, threads):
    """Every sample of `source`, decoded once by decode_pair() on `threads` threads: (images,
    masks), two stacked tensors when `size` is given, else two lists. The first bad file in the
    source's order stops it, so every process that decodes the same source says the same."""
    n = len(source)
    if size is None:
        images, masks = [None] * n, [None] * n
    else:
        images = torch.empty(n, len(mode), *size, dtype=torch.uint8)
        masks = torch.empty(n, *size, dtype=torch.uint8 if len(values) <= 256 else torch.int64)

    def put(i):
        images[i], masks[i] = decode_pair(source, i, values, mode, size)

    with ThreadPoolExecutor(threads) as pool:  # PIL and resize let go of the GIL while they work
        for _ in pool.map(put, range(n)):  # raises the first failure in order
            pass
    return images, masks


def padded(n):
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def pad_to(tensor, height, width, value):
    """[..., h, w] -> [..., height, width], filled with `value` at the bottom and right."""
    return F.pad(tensor, (0, width - tensor.shape[-1], 0, height - tensor.shape[-2]), value=value)


def pad_collate(batch):
    """(image, mask) pairs of different sizes -> one batch, padded to its largest height and width
    (rounded up to PAD_MULTIPLE): images with 0, masks with IGNORE."""
    height, width = (padded(max(mask.shape[d] for _, mask in batch)) for d in (0, 1))
    return (torch.stack([pad_to(image, height, width, 0) for image, _ in batch]),
            torch.stack([pad_to(mask, height, width, IGNORE) for _, mask in batch]))


@dataclass
class SegmentationData:
    train_loader: DataLoader
    val_loader: DataLoader
    values: list  # class i is mask value values[i]
    num_classes: int  # the setting, or the number of mask values
    input_size: Optional[tuple]  # (height, width) of every model input; None: each image its own
    in_channels: int  # the setting, or the images' (input_channels of their mode)
    max_batch_pixels: int  # bucket_by_size: the padded pixels of a training batch; else 0
    batch: object  # for common.runtime.describe(): the batch size, or what a bucketed batch holds
    shapes: str  # the images' size, for the start-up line
    reading: str  # how the images are read: cached or decoded per read, for the start-up line

    def __str__(self):
        sigmoid = " (one sigmoid output)" if self.num_classes == 1 else ""
        return (f"{self.reading}; {len(self.train_loader.dataset)} train / {len(self.val_loader.dataset)} "
                f"validation images of {self.shapes}; classes: mask values {','.join(map(str, self.values))}{sigmoid}")


def cpus_per_process(processes):
    """The CPU cores this process may use, shared out between the processes of this machine
    (LOCAL_WORLD_SIZE, set by torchrun and accelerate launch; else all `processes`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", processes)))


def worker_count(num_workers, processes):
    """num_workers; -1: a worker per CPU core of this process's share, less one for the process
    itself, at most 8 (an H100 machine's 16 cores: 8 workers gave 1.7x over 2, 14 no more)."""
    return num_workers if num_workers >= 0 else min(8, max(1, cpus_per_process(processes) - 1))


def load_data(cfg, accelerator, input_channels, augment=None, weights=None):
    """Open the data, check every mask on all processes, and build the training and validation
    loaders: plain ones for accelerator.prepare() to shard, or with bucket_by_size, bucketed
    ones that are sharded and on the device already (do not prepare them).

    input_channels(mode): the model's input channels for images of a PIL mode; every image is
    read in MODES[channels]. augment(images, masks, rand): the training batches' augmentation
    (see SegmentationSet).
    cache_images: every process decodes all the images once, into its own memory, on the
    accelerator's device (a GPU's memory cannot be shared with the other processes' GPUs), and
    gathers its batches there, with no workers; otherwise DataLoader workers decode every read.
    weights: the SegmentationWeights of --weights, whose mask values are the classes."""
    train_source, val_source = open_sources(cfg)
    require_one_batch_per_process(len(train_source), cfg.batch_size, accelerator, "the training data")
    found, sizes, modes = scan_masks(accelerator, [train_source, val_source])
    values, num_classes, input_size = classes_and_size(cfg, found, sizes, weights)
    channels = channels_of_data(cfg, modes, input_channels)
    pixels = sum(h * w for source_sizes in sizes for h, w in source_sizes)
    if input_size is not None:
        pixels = sum(map(len, sizes)) * input_size[0] * input_size[1]
    size_gb = (channels + 1) * pixels / 2**30  # uint8 channels and one byte of class per pixel
    cached = cfg.cache_images == "true" or (cfg.cache_images == "auto" and size_gb <= CACHE_BUDGET_GB)
    device, workers = accelerator.device, 0 if cached else worker_count(cfg.num_workers, accelerator.num_processes)
    if cached:
        reading = f"images decoded once, {size_gb * 1024:.0f} MB in {device.type} memory"
    else:
        where = f"by {workers} DataLoader worker(s) per process" if workers else "in the training process"
        reading = f"images decoded at every read {where}"

    def dataset(source, augment):
        cache = None
        if cached:
            threads = cpus_per_process(accelerator.num_processes)
            images, masks = decode_all(source, values, MODES[channels], input_size, threads)
            move = (lambda t: t.to(device)) if input_size else (lambda ts: [t.to(device) for t in ts])
            cache = move(images), move(masks)
        return SegmentationSet(source, values, MODES[channels], input_size, cfg.seed, augment, cache,
                               pad=cfg.bucket_by_size)

    train_set, val_set = dataset(train_source, augment), dataset(val_source, None)
    pin = device.type == "cuda" and not cached  # with non_blocking: the copy to the GPU does not wait
    if not cfg.bucket_by_size:
        # Each loader has its own generator, so starting an epoch does not draw from the global
        # RNG and a resumed run continues with the same random numbers as an uninterrupted one.
        # Persistent workers: starting them every epoch costs seconds. collate_fn=tuple: the
        # dataset returns whole batches.
        def loader(dataset, batch_size, shuffle):
            return DataLoader(dataset, batch_size, shuffle=shuffle, collate_fn=tuple, num_workers=workers,
                              persistent_workers=workers > 0, pin_memory=pin, worker_init_fn=ignore_stop_signals,
                              generator=torch.Generator().manual_seed(cfg.seed))

        train = loader(train_set, cfg.batch_size, True)
        val = loader(val_set, cfg.eval_batch_size, False)
        return SegmentationData(train, val, values, num_classes, input_size, channels, 0, cfg.batch_size,
                                f"{input_size[1]}x{input_size[0]}", reading)
    # A budget of padded pixels per batch; validation gets eval_batch_size / batch_size times more.
    train_sizes, val_sizes = ([(padded(h), padded(w)) for h, w in source_sizes] for source_sizes in sizes)
    budget = cfg.max_batch_pixels or cfg.batch_size * max(h * w for h, w in train_sizes)
    train = bucket_loader(train_set, train_sizes, budget, accelerator, train=True, seed=cfg.seed,
                          collate_fn=tuple, num_workers=workers, pin_memory=pin)
    val = bucket_loader(val_set, val_sizes, max(budget * cfg.eval_batch_size // cfg.batch_size, 1), accelerator,
                        train=False, collate_fn=tuple, num_workers=workers, pin_memory=pin)
    batch = f"batches of at most {budget} padded pixels per process"
    return SegmentationData(train, val, values, num_classes, None, channels, budget, batch, "their own sizes",
                            reading)


def predicted_classes(logits, num_classes):
    """Hard predictions [N, H, W]: argmax, or logit > 0 (sigmoid > 0.5) for one class."""
    return (logits[:, 0] > 0).long() if num_classes == 1 else logits.argmax(1)


# Class 0 (and padding) black, then a colour per class, repeating after six.
COLOURS = torch.tensor([(0, 0, 0), (230, 25, 75), (60, 180, 75), (0, 130, 200), (255, 225, 25), (145, 30, 180),
                        (70, 240, 240)], dtype=torch.uint8)


def paint(classes):
    """Class indices [..., H, W] -> uint8 colours [..., H, W, 3]."""
    classes = classes.clamp(min=0)
    return COLOURS.to(classes.device)[torch.where(classes > 0, (classes - 1) % (len(COLOURS) - 1) + 1, 0)]


def image_panel(x, logits, target, num_classes, count=4):
    """image | prediction | truth of the first `count` images, side by side: floats [N, 3, H, 3W].
    x: uint8 images of any channels, shown as RGB (grey for 1 or 2, without alpha for 4)."""
    pred = predicted_classes(logits[:count], num_classes)
    painted = [paint(c).permute(0, 3, 1, 2) for c in (pred, target[:count])]
    rgb = x[:count, :3] if x.shape[1] >= 3 else x[:count, [0, 0, 0]]
    return torch.cat([rgb, *painted], dim=3).float() / 255


@dataclass
class SegmentationWeights:
    """What predict needs besides the tensors, stored in the weights file's metadata as one JSON
    entry, so it reads back typed: the model's settings, the classes and the training size."""

    model: dict  # the Config fields the model is built from, e.g. {"num_classes": 4, "base_channels": 64}
    mask_values: list  # class i is mask value mask_values[i]
    input_size: Optional[list]  # [height, width] that the model saw; None: each image at its own size
    # The flips of its training augmentation, which predict_flip averages over: "h" (horizontal),
    # "v" (vertical), both or "". Files written before it was stored: "h", the recipe's default.
    flips: str = "h"

    KEY = "segmentation"

    @property
    def in_channels(self):
        """The model's input channels: files written before they were stored took RGB."""
        return self.model.get("in_channels", 3)

    def metadata(self, **more):
        """The safetensors metadata for save_weights(), with `more` entries beside it."""
        return {self.KEY: json.dumps(dataclasses.asdict(self)), **more}

    @classmethod
    def read(cls, path):
        """The settings stored in a weights file or an exported .onnx file; None if it holds none
        (or is neither)."""
        if Path(path).suffix not in (".safetensors", ".onnx") or not Path(path).is_file():
            return None  # load_weights reports a missing file
        if Path(path).suffix == ".onnx":
            meta = onnx_metadata(path)  # export_onnx copied the weights file's metadata
        else:
            try:
                with safe_open(path, "pt") as f:
                    meta = f.metadata() or {}
            except SafetensorError as e:
                raise UserError(f"cannot read weights file {path} ({e}): it is truncated or not a weights file") from None
        if cls.KEY in meta:
            return cls(**json.loads(meta[cls.KEY]))
        if "mask_values" in meta:  # written before the settings were one entry: strings, one per key
            size = meta["input_size"]
            model = {"in_channels": 3, "num_classes": int(meta["num_classes"]), "base_channels": int(meta["base_channels"]),
                     "bilinear": meta["bilinear"] == "True"}
            return cls(model, parse_values(meta["mask_values"], "mask_values"),
                       None if size == "native" else [int(n) for n in size.split(",")])
        return None


def fit_to_weights(cfg, weights, names):
    """cfg with the model settings `names` that `weights` was trained with: num_classes and
    in_channels 0 (from the data) take the stored value; a setting that differs stops with a line naming it."""
    if weights is None:
        return cfg
    settings = {"in_channels": weights.in_channels, **weights.model}
    for name in names:
        stored, given = settings.get(name), getattr(cfg, name)
        if name in ("num_classes", "in_channels") and given == 0:
            cfg = dataclasses.replace(cfg, **{name: stored})
        elif stored is not None and stored != given:
            raise UserError(f"{cfg.weights} was trained with {name} {stored}, not {given}: add --{name} {stored}")
    return cfg


def require_same_classes(state, values, checkpoint):
    """A checkpoint resumes only on data whose mask values map to the same classes."""
    if state["mask_values"] != values:
        raise DataError(f"checkpoint {checkpoint} maps mask values {state['mask_values']}, this data "
                        f"{values}: set --mask_values to match, or start a new run")


def tile_starts(size, tile):
    """Where the tiles along an image side of `size` pixels start: every `stride` pixels, a
    multiple of 16 so that each tile meets the U-Net's pooling grid where the whole image would,
    overlapping by a quarter of a tile or more; the last tile ends at the edge."""
    stride = max(PAD_MULTIPLE, (tile - tile // 4) // PAD_MULTIPLE * PAD_MULTIPLE)
    return [*range(0, size - tile, stride), size - tile]


def gaussian_weights(height, width, device):
    """[height, width] weights for blending tiles, highest at the centre (sigma 1/8 of the side,
    as nnU-Net): the logits near a tile's edge, which saw the zero padding past it, count least."""
    def side(n):
        offsets = torch.arange(n, dtype=torch.float32, device=device) - (n - 1) / 2
        return torch.exp(-0.5 * (offsets / (n / 8)) ** 2)  # 3e-4 at the edge, never 0

    return side(height)[:, None] * side(width)[None]


def tiled(net, x, tile):
    """net(x) for images x [N, C, H, W], or, where they are larger than tile x tile, the logits
    of overlapping tiles blended with Gaussian weights. The network sees one tile at a time, so
    its memory grows with the tile; only the logits (fp32) grow with the image."""
    height, width = x.shape[-2:]
    if not tile or (height <= tile and width <= tile):
        return net(x)
    tile_h, tile_w = min(tile, height), min(tile, width)
    weights = gaussian_weights(tile_h, tile_w, x.device)
    logits = total = None
    for top, left in itertools.product(tile_starts(height, tile_h), tile_starts(width, tile_w)):
        window = (..., slice(top, top + tile_h), slice(left, left + tile_w))
        part = net(x[window]).float()
        if logits is None:
            logits = part.new_zeros((*part.shape[:2], height, width))
            total = part.new_zeros((height, width))
        logits[window] += part * weights
        total[window] += weights
    return logits.div_(total)


def segment(net, x, cfg, flips):
    """The logits of images x [N, 3, H, W] as predict and evaluation compute them: net(x), or
    with cfg.predict_tile, from tiles (tiled()), and with cfg.predict_flip, the mean over the
    image and its flips along the axes the model was trained to flip (`flips`: "h", "v", both).
    The mean of the logits, not of the probabilities: it stays logits, for the loss, the argmax
    and the tiles' blend, and one class (sigmoid) and several (softmax) are averaged alike."""
    if not cfg.predict_flip:
        return tiled(net, x, cfg.predict_tile)
    if not flips:
        raise UserError("predict_flip averages over the flips of training, and this model was trained with "
                        "none (hflip and vflip 0): leave predict_flip off")
    axes = [dim for axis, dim in (("v", 2), ("h", 3)) if axis in flips]
    views = [dims for n in range(len(axes) + 1) for dims in itertools.combinations(axes, n)]
    logits = sum(tiled(net, x.flip(dims), cfg.predict_tile).float().flip(dims) for dims in views)
    return logits / len(views)


def load_model(cfg, build_model, device="cpu"):
    """(model, SegmentationWeights) of the --weights file, for predict and export: the model that
    build_model(settings) makes from the settings stored in the file, with its weights, in eval
    mode on `device`; or for an .onnx file, an onnxruntime session that is called alike."""
    weights = SegmentationWeights.read(cfg.weights)
    if weights is None:
        raise UserError(f"{cfg.weights} holds no segmentation settings: predict and export need weights saved by this recipe")
    if Path(cfg.weights).suffix == ".onnx":
        return OnnxModel(cfg.weights), weights
    model = build_model(weights.model)
    load_weights(model, cfg.weights)
    return model.to(device).eval(), weights


def sample_images(cfg, weights, count=4):
    """Up to `count` validation images as the data gives them (uint8 [N, C, H, W]), at
    the size it was trained on (input_size, or the first image's own size padded), and the first
    one again at another size (16 and 32 pixels more): real inputs to check an export on."""
    from torchvision.transforms.v2.functional import resize  # see decode_pair

    _, val_source = open_sources(cfg)
    mode = MODES[weights.in_channels]
    images = [decode_pair(val_source, i, weights.mask_values, mode)[0] for i in range(min(count, len(val_source)))]
    h, w = weights.input_size or (padded(images[0].shape[1]), padded(images[0].shape[2]))
    return [torch.stack([resize(im, [h, w], antialias=True) for im in images]),
            resize(images[0], [h + 16, w + 32], antialias=True)[None]]


def predict(cfg, accelerator, build_model, prepare_input):
    """A mask PNG per image of the --predict glob, at the image's size, in the training masks'
    values; --overlay also paints the classes on the image. Each process does a share.
    build_model(settings) rebuilds the model from the settings stored in the weights file;
    prepare_input(x) makes the model's input of uint8 images [N, C, H, W] in its channels."""
    from torchvision.transforms.v2.functional import pil_to_tensor, resize  # see decode_pair

    model, weights = load_model(cfg, build_model, accelerator.device)
    num_classes = weights.model["num_classes"]
    files = sorted(p for p in glob.glob(cfg.predict) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
    if not files or len({Path(p).stem for p in files}) < len(files):
        raise DataError(f"--predict {cfg.predict!r} matches {'two images of one name' if files else 'no image files'}")
    for path in files:  # every process opens every header, so a bad file stops them all alike
        try:
            Image.open(path).close()
        except OSError as e:
            raise DataError(f"cannot read image {path}: {e}") from None
    out = Path(cfg.predict_dir or Path(cfg.output_dir) / "predictions")
    out.mkdir(parents=True, exist_ok=True)
    values = weights.mask_values
    lut = np.array(values, np.uint8 if max(values) < 256 else np.uint16)  # class index -> mask value
    # The model sees images as in training: resized to input_size, or at their own size
    # (bucket_by_size), padded like a training batch, one at a time. predict_tile applies at
    # that scale: it lets a model trained at its images' own size take large ones.
    native = weights.input_size is None
    batch_size = 1 if native else cfg.eval_batch_size
    with accelerator.split_between_processes(files) as mine:
        for start in range(0, len(mine), batch_size):
            paths = mine[start : start + batch_size]
            images = [Image.open(p).convert(MODES[weights.in_channels]) for p in paths]
            if native:
                x = pad_to(pil_to_tensor(images[0]), padded(images[0].height), padded(images[0].width), 0)[None]
            else:
                x = torch.stack([resize(pil_to_tensor(im), weights.input_size, antialias=True) for im in images])
            with torch.inference_mode(), accelerator.autocast():
                logits = segment(model, prepare_input(x.to(accelerator.device)), cfg, weights.flips)
            for path, image, lg in zip(paths, images, logits):
                if native:
                    lg = lg[:, : image.height, : image.width].float()
                else:
                    lg = F.interpolate(lg[None].float(), (image.height, image.width), mode="bilinear")[0]
                classes = predicted_classes(lg[None], num_classes)[0].cpu()
                Image.fromarray(lut[classes.numpy()]).save(out / f"{Path(path).stem}_mask.png")
                if cfg.overlay:
                    rgb = torch.from_numpy(np.asarray(image.convert("RGB"), np.float32))
                    rgb = torch.where(classes[..., None] > 0, 0.5 * rgb + 0.5 * paint(classes), rgb)
                    Image.fromarray(rgb.numpy().astype(np.uint8)).save(out / f"{Path(path).stem}_overlay.png")
    accelerator.wait_for_everyone()
    accelerator.print(f"wrote {len(files)} masks (values {','.join(map(str, values))}) to {out}/")
