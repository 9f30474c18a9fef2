"""The U-Net recipe's data: image and mask pairs, mask values and classes, and the loaders,
plain or bucketed by size. A folder with imgs/ and masks/ (Carvana's layout: imgs/NAME.jpg with
masks/NAME.png or masks/NAME_mask.gif), or what datasets.load_dataset reads, with an image and a
mask column. A mask holds a grey level or palette index per class: class i is mask value
values[i]. Images are read in the mode of the model's input channels (MODES).

    data = load_data(cfg, accelerator, input_channels, augment, weights)  # weights: for classes
    data.train_loader, data.val_loader, data.values, data.num_classes, data.input_size
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from unet_model import MIN_SIZE, PAD_MULTIPLE

from common.config import RunConfig, require, require_at_least
from common.data import (
    IMAGE_ERRORS,
    DataError,
    TableRows,
    cpus_per_process,
    load_splits,
    open_image,
    pad_to,
    require_one_batch_per_process,
    seeded_loader,
    to_device,
    unreadable_image,
    worker_count,
)
from common.sampler import bucket_loader

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp"}
IGNORE = -1  # the class of padded pixels: no loss, no Dice
SHAPES = "data/shapes"  # the U-Net's default data, made by `make data/shapes`
RANDOMS = 8  # uniform random numbers per training sample that an augmentation gets (rand[n])
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # input channels -> the PIL mode images are read in
CACHE_BUDGET_GB = 4  # cache_images auto: decode once if images and masks fit this, per process


@dataclass
class SegmentationConfig(RunConfig):
    """The settings of load_data() beside the recipe's own: layout, classes, bucketing, cache."""

    val_fraction: float = 0.1  # imgs/ + masks/: share held out for validation, fixed for any seed
    image_column: str = "image"  # datasets data: the column of images
    mask_column: str = "mask"  # datasets data: the column of masks
    train_split: str = "train"  # datasets data
    val_split: str = "validation"  # datasets data
    mask_values: str = ""  # mask values in class order, e.g. "0,255"; empty: the values found
    num_classes: int = 0  # with background; 0: one per mask value; 1: a sigmoid, for 2 values
    in_channels: int = 0  # of the model's input: 1 grey, 3 RGB, 4 RGBA; 0: the images' own
    # Images of different sizes: train and evaluate each at its own size, in similar-size batches.
    bucket_by_size: bool = False  # batches padded to their largest image, which loss and Dice skip
    max_batch_pixels: int = 0  # bucket_by_size: padded pixels per batch; 0: batch_size x largest
    # Decoding: once at start-up, into memory (a GPU's with CUDA), or at every read in workers.
    cache_images: bool | None = None  # auto: decode once if images + masks take <= 4 GiB

    def validate(self):
        super().validate()
        require_at_least(self, 0, "num_classes", "max_batch_pixels")
        require(
            self.in_channels in (0, *MODES),
            f"in_channels must be 0 (from the images), 1, 2, 3 or 4, got {self.in_channels}",
        )
        require(
            0 < self.val_fraction < 1,
            f"val_fraction must be between 0 and 1, got {self.val_fraction}",
        )
        if self.mask_values:
            count = value_count(self.num_classes) if self.num_classes else None
            given = parse_values(self.mask_values, "--mask_values")
            require(
                count in (None, len(given)),
                f"mask_values needs one value per class ({count} "
                f"for num_classes {self.num_classes}), got {self.mask_values!r}",
            )


def parse_values(text, where):
    """'0,85,170' -> [0, 85, 170]: distinct non-negative integers, or a ConfigError."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    require(
        values and min(values) >= 0 and len(set(values)) == len(values),
        f"{where} must be distinct non-negative integers separated by commas, like 0,255; "
        f"got {text!r}",
    )
    return values


def value_count(num_classes):
    """How many mask values a model tells apart: a 1-class (sigmoid) model has two."""
    return 2 if num_classes == 1 else num_classes


def folder_pairs(root):
    """[(image path, mask path, name)] for imgs/NAME.* with masks/NAME.* or masks/NAME_mask.*."""

    def files(folder):
        return {
            p.stem: p
            for p in sorted((root / folder).iterdir())
            if p.suffix.lower() in IMAGE_SUFFIXES
        }

    masks, pairs = files("masks"), []
    for stem, image in files("imgs").items():
        found = [masks[s] for s in (stem, stem + "_mask") if s in masks]
        if len(found) != 1:
            raise DataError(
                f"{image} has {'two masks' if found else 'no mask'}: expected one of "
                f"masks/{stem}.png or masks/{stem}_mask.png (any image type)"
            )
        pairs.append((image, found[0], str(found[0])))
    if not pairs:
        raise DataError(f"{root / 'imgs'} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return pairs


def open_sources(cfg):
    """The train and validation sources, from imgs/ + masks/ or from datasets. A source is a
    sequence of (image, mask, name); the name is for messages."""
    root = Path(cfg.dataset)
    if cfg.dataset == SHAPES and not root.exists():
        raise DataError(
            f"{root} does not exist yet: write it with `make data/shapes` or python "
            f"scripts/make_shapes.py"
        )
    if (root / "imgs").is_dir() and not (root / "masks").is_dir():
        raise DataError(
            f"{root} has imgs/ but no masks/: add masks/NAME.png or masks/NAME_mask.* "
            f"for each imgs/NAME.*"
        )
    if (root / "imgs").is_dir():
        pairs = folder_pairs(root)
        n_val = int(len(pairs) * cfg.val_fraction)
        if not 0 < n_val < len(pairs):
            raise DataError(
                f"val_fraction {cfg.val_fraction} of {len(pairs)} images leaves none "
                f"to validate or train"
            )
        # A fixed generator, as in milesial/Pytorch-UNet: the held-out images stay for any seed.
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
        return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]
    hint = (
        f"use a folder with imgs/ and masks/ (masks/NAME.png or masks/NAME_mask.* for each "
        f"imgs/NAME.*), or parquet files {cfg.train_split}*.parquet and "
        f"{cfg.val_split}*.parquet with columns {cfg.image_column} and {cfg.mask_column}"
    )
    columns = [cfg.image_column, cfg.mask_column]
    splits = load_splits(cfg.dataset, [cfg.train_split, cfg.val_split], columns, hint)
    return [
        TableRows(splits[split], columns, f"{cfg.dataset} {split}", "image or mask")
        for split in (cfg.train_split, cfg.val_split)
    ]


def read_pair(image, mask, name):
    """A PIL image and its mask as an integer array of pixel values (grey levels or palette
    indices). A file PIL cannot read stops with a DataError naming it. The image's pixels are
    decoded when used (decode_pair), so a scan reads only its header."""
    image, mask = (
        open_image(p, kind) if isinstance(p, Path) else p
        for p, kind in ((image, "image"), (mask, "mask"))
    )
    if not isinstance(mask, Image.Image):
        raise DataError(
            f"{name}: the mask is a {type(mask).__name__}, not an image: check mask_column"
        )
    try:
        values = np.asarray(mask.convert("L") if mask.mode == "1" else mask)
    except IMAGE_ERRORS as e:  # a truncated or broken mask file
        raise unreadable_image(name, e, "mask") from None
    if values.ndim == 3:  # a grey mask saved as RGB(A): keep one channel if the others agree
        if not (values[..., :3] == values[..., :1]).all():
            raise DataError(
                f"mask {name} is in colour: save one grey level or palette index per class"
            )
        values = values[..., 0]
    if image.size != values.shape[::-1]:
        raise DataError(
            f"mask {name} is {values.shape[1]}x{values.shape[0]}, its image "
            f"{image.width}x{image.height}"
        )
    return image, values.astype(np.int64)


def scan_masks(accelerator, sources):
    """{mask value: [number of masks holding it, one of them]}, per source the (height, width)
    of each image, in order, and {image mode: an image of that mode}. Each process reads its
    share of the pairs and the results are gathered, so a bad file stops every rank with the
    same one-line error (never one rank raising while the others wait)."""
    found, sizes, modes, problems = {}, {}, {}, []
    items = [(s, i) for s, source in enumerate(sources) for i in range(len(source))]
    for s, i in items[accelerator.process_index :: accelerator.num_processes]:
        try:
            path, mask, name = sources[s][i]
            image, values = read_pair(path, mask, name)
        except (DataError, OSError, Image.DecompressionBombError) as e:  # OSError: PIL's
            problems.append(str(e))
            continue
        sizes[s, i] = values.shape
        modes.setdefault(image.mode, str(path) if isinstance(path, Path) else name)
        for v in np.unique(values).tolist():
            found.setdefault(v, [0, name])[0] += 1
    merged, all_sizes, all_modes = {}, {}, {}
    for found_at, sizes_at, modes_at, problems in gather_object([(found, sizes, modes, problems)]):
        if problems:
            raise DataError(problems[0])
        all_sizes.update(sizes_at)
        all_modes = {**modes_at, **all_modes}
        for v, (count, name) in found_at.items():
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
        raise DataError(
            f"images have different channels: {name1} is {mode1} ({few}), {name2} is "
            f"{mode2} ({many}): convert them to one mode, or set --in_channels {many} "
            f"to read all as {MODES[many]}"
        )
    return next(iter(seen))


def classes_and_size(cfg, found, sizes, weights):
    """(mask values in class order, num_classes, input size (h, w) or None for each its own).
    The values come from --mask_values, else the weights file, else the sorted values found;
    num_classes from the setting, else the number of values."""
    text = cfg.mask_values
    values = (
        parse_values(text, "mask_values")
        if text
        else weights.mask_values
        if weights
        else sorted(found)
    )
    shown = ",".join(map(str, values[:8]))
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise DataError(
            f"mask {found[unknown[0]][1]} has value {unknown[0]}, which is not one of "
            f"mask_values {','.join(map(str, values))}: fix the mask, or list the "
            f"value in --mask_values"
        )
    if len(values) < 2:
        raise DataError(
            f"every mask holds only the value {values[0]}: a model needs a background "
            f"and at least one class; check the masks, or set --mask_values"
        )
    num_classes = cfg.num_classes or len(values)
    if len(values) != value_count(num_classes) and (text or weights):
        raise DataError(
            f"{'--mask_values' if text else cfg.weights} gives {len(values)} mask "
            f"values, which does not fit num_classes {num_classes}: set --num_classes"
        )
    rare = min(values, key=lambda v: found.get(v, [0])[0])
    if len(values) != value_count(num_classes):
        raise DataError(
            f"the masks hold {len(values)} values ({shown}) where num_classes "
            f"{num_classes} expects {value_count(num_classes)}; the rarest, {rare}, "
            f"is in {found[rare][0]} mask(s), such as {found[rare][1]}: fix the masks, "
            f"set --num_classes, or set --mask_values to the values that are classes"
        )
    masks = sum(len(source_sizes) for source_sizes in sizes)
    inferred = not (cfg.num_classes or text or weights)
    if inferred and (len(values) > 32 or (found[rare][0] == 1 and masks >= 20)):
        # Inferred classes: a value in a single mask, or dozens of values (antialiased or JPEG
        # masks), is more likely a broken mask than a class.
        raise DataError(
            f"the masks hold {len(values)} values ({shown}); the rarest, {rare}, is in "
            f"{found[rare][0]} of {masks} masks, such as {found[rare][1]}: fix the "
            f"masks, set --mask_values to the values that are classes, or "
            f"--num_classes {len(values)} to keep them all"
        )
    if cfg.image_size:
        return values, num_classes, (cfg.image_size, cfg.image_size)
    if cfg.bucket_by_size:
        return values, num_classes, None  # every image keeps its own size
    distinct = sorted({size for source_sizes in sizes for size in source_sizes})
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[:2]
        raise DataError(
            f"images have different sizes ({w1}x{h1}, {w2}x{h2}): set --image_size "
            f"to resize them, or --bucket_by_size true to train on each at its own "
            f"size"
        )
    ((h, w),) = distinct
    if min(w, h) < max(MIN_SIZE, cfg.crop_size):
        raise DataError(
            f"images are {w}x{h}, smaller than crop_size or the U-Net's {MIN_SIZE} "
            f"pixels: set --image_size"
        )
    return values, num_classes, (h, w)


class SegmentationSet(Dataset):
    """Whole batches, read a batch at a time (`__getitems__`): uint8 images [N, C, H, W] and
    int64 class indices [N, H, W], then `augment(images, masks, rand)` if given (training).
    The images come from `cache` (decode_all, on any device: a batch is gathered and augmented
    there), or are decoded from `source` at every read, in DataLoader workers. `pad`: images of
    different sizes, padded per batch (pad_collate). rand[n]: RANDOMS uniform numbers for the
    batch's n-th sample, seeded with (seed, epoch, sample index): the same augmentation for any
    number of workers or processes, cached or not, and after a resume. `epoch` lives in shared
    memory, so persistent workers see the recipe set it before each epoch."""

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
            pairs = [
                decode_pair(self.source, i, self.values, self.mode, self.size) for i in indices
            ]
        elif self.pad:  # a list of images of their own sizes
            pairs = [(self.cache[0][i], self.cache[1][i]) for i in indices]
        else:  # one gather per tensor, where the cache is
            index = to_device(torch.as_tensor(indices), self.cache[0].device)
            images = self.cache[0].index_select(0, index)
            masks = self.cache[1].index_select(0, index).long()
        if self.cache is None or self.pad:
            pairs = [(image, mask.long()) for image, mask in pairs]
            images, masks = pad_collate(pairs) if self.pad else map(torch.stack, zip(*pairs))
        if self.augment is None:
            return images, masks
        return self.augment(images, masks, self.randoms(indices))

    def randoms(self, indices):
        """[len(indices), RANDOMS] uniform numbers in [0, 1), each row from its sample's seed."""
        gen, base = torch.Generator(), (self.seed * 1_000_003 + self.epoch) * 1_000_003
        return torch.stack(
            [torch.rand(RANDOMS, generator=gen.manual_seed(base + i)) for i in indices]
        )


def decode_pair(source, i, values, mode, size=None):
    """Sample i of `source` as uint8 tensors: the image in PIL `mode` [C, H, W] and its class
    indices [H, W] (int64 past 256 classes), resized to `size` (height, width) if given, the
    mask by nearest neighbour. A DataError names a file that fails."""
    # Here, not at the top: torchvision loads torch's compiler (over 1 s), which --help skips.
    from torchvision.transforms.v2.functional import InterpolationMode, pil_to_tensor, resize

    path, mask, name = source[i]  # a table row is decoded here, once
    image, mask_values = read_pair(path, mask, name)
    try:
        image = image.convert(mode)  # decodes an image file: scan_masks read only its header
    except IMAGE_ERRORS as e:  # such as a truncated file
        raise unreadable_image(path if isinstance(path, Path) else name, e) from None
    lut = np.zeros(
        max(max(values), int(mask_values.max())) + 1, np.uint8 if len(values) <= 256 else np.int64
    )
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
        images = torch.empty(n, len(mode), *size, dtype=torch.uint8)  # a band per letter: RGB 3
        masks = torch.empty(n, *size, dtype=torch.uint8 if len(values) <= 256 else torch.int64)

    def put(i):
        images[i], masks[i] = decode_pair(source, i, values, mode, size)

    with ThreadPoolExecutor(threads) as pool:  # PIL and resize let go of the GIL while they work
        for _ in pool.map(put, range(n)):  # raises the first failure in order
            pass
    return images, masks


def padded(n):
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def pad_collate(batch):
    """(image, mask) pairs of different sizes -> one batch, padded to its largest height and
    width (rounded up to PAD_MULTIPLE): images with 0, masks with IGNORE."""
    height, width = (padded(max(mask.shape[d] for _, mask in batch)) for d in (0, 1))
    return (
        torch.stack([pad_to(image, height, width, 0) for image, _ in batch]),
        torch.stack([pad_to(mask, height, width, IGNORE) for _, mask in batch]),
    )


@dataclass
class SegmentationData:
    train_loader: DataLoader
    val_loader: DataLoader
    values: list  # class i is mask value values[i]
    num_classes: int  # the setting, or the number of mask values
    input_size: tuple | None  # (height, width) of every model input; None: each image its own
    in_channels: int  # the setting, or the images' (input_channels of their mode)
    max_batch_pixels: int  # bucket_by_size: the padded pixels of a training batch; else 0
    batch: object  # for common.runtime.describe(): the batch size, or what a bucketed batch holds
    shapes: str  # the images' size, for the start-up line
    reading: str  # how the images are read: cached or decoded per read, for the start-up line
    cached: bool  # cache_images as resolved: decoded once at start-up

    def __str__(self):
        sigmoid = " (one sigmoid output)" if self.num_classes == 1 else ""
        return (
            f"{self.reading}; {len(self.train_loader.dataset)} train / "
            f"{len(self.val_loader.dataset)} validation images of {self.shapes}; classes: mask "
            f"values {','.join(map(str, self.values))}{sigmoid}"
        )


def load_data(cfg, accelerator, input_channels, augment=None, weights=None):
    """Open the data, check every mask on all processes, and build the training and validation
    loaders: plain ones for accelerator.prepare() to shard, or with bucket_by_size, bucketed
    ones that are sharded and on the device already (do not prepare them).
    input_channels(mode): the model's input channels for images of a PIL mode. augment(images,
    masks, rand): see SegmentationSet. cache_images: each process decodes all images once onto
    its device (a GPU's memory is its own) and gathers its batches there, with no workers.
    weights: the SegmentationWeights of --weights, whose mask values are the classes."""
    train_source, val_source = open_sources(cfg)
    require_one_batch_per_process(
        len(train_source), cfg.batch_size, accelerator, "the training data"
    )
    found, sizes, modes = scan_masks(accelerator, [train_source, val_source])
    values, num_classes, input_size = classes_and_size(cfg, found, sizes, weights)
    channels = channels_of_data(cfg, modes, input_channels)
    pixels = sum(h * w for source_sizes in sizes for h, w in source_sizes)
    if input_size is not None:
        pixels = sum(map(len, sizes)) * input_size[0] * input_size[1]
    size_gb = (channels + 1) * pixels / 2**30  # uint8 channels and one byte of class per pixel
    cached = size_gb <= CACHE_BUDGET_GB if cfg.cache_images is None else cfg.cache_images
    device = accelerator.device
    workers = 0 if cached else worker_count(cfg.num_workers, accelerator.num_processes)
    if cached:
        reading = f"images decoded once, {size_gb * 1024:.0f} MB in {device.type} memory"
    else:
        where = f"by {workers} DataLoader worker(s) per" if workers else "in the training"
        reading = f"images decoded at every read {where} process"

    def dataset(source, augment):
        cache = None
        if cached:
            threads = cpus_per_process(accelerator.num_processes)
            images, masks = decode_all(source, values, MODES[channels], input_size, threads)
            to = (lambda t: t.to(device)) if input_size else (lambda ts: [t.to(device) for t in ts])
            cache = to(images), to(masks)
        return SegmentationSet(
            source,
            values,
            MODES[channels],
            input_size,
            cfg.seed,
            augment,
            cache,
            pad=cfg.bucket_by_size,
        )

    train_set, val_set = dataset(train_source, augment), dataset(val_source, None)
    pin = device.type == "cuda" and not cached  # non_blocking: the copy to the GPU does not wait
    known = (values, num_classes, input_size, channels)
    if not cfg.bucket_by_size:  # each loader with its own generator: see seeded_loader
        train = seeded_loader(train_set, cfg.batch_size, True, cfg.seed, workers, pin)
        val = seeded_loader(val_set, cfg.eval_batch_size, False, cfg.seed, workers, pin)
        return SegmentationData(
            train,
            val,
            *known,
            0,
            cfg.batch_size,
            f"{input_size[1]}x{input_size[0]}",
            reading,
            cached,
        )
    # A budget of padded pixels per batch; validation gets eval_batch_size / batch_size times more.
    train_sizes, val_sizes = ([(padded(h), padded(w)) for h, w in part] for part in sizes)
    budget = cfg.max_batch_pixels or cfg.batch_size * max(h * w for h, w in train_sizes)
    train = bucket_loader(
        train_set,
        train_sizes,
        budget,
        accelerator,
        train=True,
        seed=cfg.seed,
        collate_fn=tuple,
        num_workers=workers,
        pin_memory=pin,
    )
    val_budget = max(budget * cfg.eval_batch_size // cfg.batch_size, 1)
    val = bucket_loader(
        val_set,
        val_sizes,
        val_budget,
        accelerator,
        train=False,
        collate_fn=tuple,
        num_workers=workers,
        pin_memory=pin,
    )
    batch = f"batches of at most {budget} padded pixels per process"
    return SegmentationData(train, val, *known, budget, batch, "their own sizes", reading, cached)
