"""Image and mask pairs for semantic segmentation, from the recipe's pairs to loaders, in one call:

    data = load_segmentation(train_pairs, val_pairs, accelerator=accelerator, values=None,
                             batch_size=8, eval_batch_size=16, seed=0, ...)
    data.train_loader    # batches (images, masks, rand): augment them per sample with rand
    data.val_loader      # batches (images, masks)
    data.values, data.num_classes, data.in_channels, data.input_size

A split of pairs is a sequence whose item i is (PIL image, integer array [H, W] of mask values,
name), read when indexed (the recipe's Pairs). Class i is mask value values[i]. Images are
decoded in the PIL mode of the model's input channels (MODES), and masks become class indices:
uint8 up to 256 classes, int64 beyond. Behind load_segmentation():
- every mask is scanned once, each process a share, and a bad one stops every rank with the same
  one-line error (scan_pairs);
- the classes and the input size are checked against the settings (classes_and_size);
- decoding happens once into memory (and, between runs, through common.cache), or at every read
  in DataLoader workers;
- each training sample gets its own uniform random numbers, seeded with (seed, epoch, sample):
  the same augmentation for any number of workers or processes, cached or not, and after a resume;
- images of different sizes are padded per batch (pad_collate, IGNORE in the masks), in batches of
  similar sizes under a pixel budget (common.sampler.bucket_loader).
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from accelerate.utils import gather_object
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from common.cache import cached_tensors
from common.data import (
    IMAGE_ERRORS,
    DataError,
    cpus_per_process,
    pad_to,
    require_one_batch_per_process,
    seeded_loader,
    to_device,
    unreadable_image,
    worker_count,
)
from common.sampler import bucket_loader

IGNORE = -1  # the class of padded pixels: no loss, no metric
RANDOMS = 8  # uniform random numbers per training sample that an augmentation gets (rand[n])
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # input channels -> the PIL mode images are read in
GREY_MODES = ("1", "L", "I", "I;16", "F")
ALPHA_MODES = ("RGBA", "LA", "PA")
CACHE_BUDGET_GB = 4  # cache_images auto: decode once if images and masks fit this, per process


def value_count(num_classes):
    """How many mask values a model tells apart: a 1-class (sigmoid) model has two."""
    return 2 if num_classes == 1 else num_classes


def input_channels(mode):
    """The model's input channels for images of a PIL mode: grey 1, with alpha 4, else RGB's 3."""
    return 1 if mode in GREY_MODES else 4 if mode in ALPHA_MODES else 3


def scan_pairs(accelerator, splits):
    """{mask value: [number of masks holding it, one of them]}, per split the (height, width)
    of each image, in order, and {image mode: an image of that mode}. Each process reads its
    share of the pairs and the results are gathered, so a bad file stops every rank with the
    same one-line error (never one rank raising while the others wait)."""
    found, sizes, modes, problems = {}, {}, {}, []
    items = [(s, i) for s, split in enumerate(splits) for i in range(len(split))]
    for s, i in items[accelerator.process_index :: accelerator.num_processes]:
        try:
            image, values, name = splits[s][i]
        except (DataError, OSError, Image.DecompressionBombError) as e:  # OSError: PIL's
            problems.append(str(e))
            continue
        sizes[s, i] = values.shape
        modes.setdefault(image.mode, getattr(image, "filename", "") or name)
        for v in np.unique(values).tolist():
            found.setdefault(v, [0, name])[0] += 1
    merged, all_sizes, all_modes = {}, {}, {}
    for found_at, sizes_at, modes_at, problems_at in gather_object(
        [(found, sizes, modes, problems)]
    ):
        if problems_at:
            raise DataError(problems_at[0])
        all_sizes.update(sizes_at)
        all_modes = {**modes_at, **all_modes}
        for v, (count, name) in found_at.items():
            merged.setdefault(v, [0, name])[0] += count
    sizes = [[all_sizes[s, i] for i in range(len(split))] for s, split in enumerate(splits)]
    return merged, sizes, all_modes


def channels_of_data(in_channels, modes):
    """The model's input channels: `in_channels` (the setting or the weights'), else those of
    the images' modes (input_channels()), which must agree."""
    if in_channels:
        return in_channels
    seen = {}
    for mode, name in sorted(modes.items()):
        seen.setdefault(input_channels(mode), (mode, name))
    if len(seen) > 1:
        (few, (mode1, name1)), (many, (mode2, name2)) = sorted(seen.items())[:2]
        raise DataError(
            f"images have different channels: {name1} is {mode1} ({few}), {name2} is {mode2} "
            f"({many}): convert them to one mode, or set --in_channels {many} to read all as "
            f"{MODES[many]}"
        )
    return next(iter(seen))


def classes_and_size(
    found, sizes, *, values, num_classes, fixed, image_size, bucket_by_size, min_size
):
    """(mask values in class order, num_classes, input size (h, w) or None for each its own).
    values: the classes' mask values as given (fixed: by a setting or a weights file), or None
    for the sorted values found; num_classes: the setting, 0 for the number of values.
    image_size: (h, w) to resize to, or None. min_size: the smallest side the model takes."""
    given = values is not None
    values = values if given else sorted(found)
    shown = ",".join(map(str, values[:8]))
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise DataError(
            f"mask {found[unknown[0]][1]} has value {unknown[0]}, which is not one of "
            f"mask_values {','.join(map(str, values))}: fix the mask, or list the value in "
            f"--mask_values"
        )
    if len(values) < 2:
        raise DataError(
            f"every mask holds only the value {values[0]}: a model needs a background and at "
            f"least one class; check the masks, or set --mask_values"
        )
    inferred = not (num_classes or given)
    num_classes = num_classes or len(values)
    if len(values) != value_count(num_classes) and given:
        raise DataError(
            f"{fixed} gives {len(values)} mask values, which does not fit num_classes "
            f"{num_classes}: set --num_classes"
        )
    rare = min(values, key=lambda v: found.get(v, [0])[0])
    if len(values) != value_count(num_classes):
        raise DataError(
            f"the masks hold {len(values)} values ({shown}) where num_classes {num_classes} "
            f"expects {value_count(num_classes)}; the rarest, {rare}, is in {found[rare][0]} "
            f"mask(s), such as {found[rare][1]}: fix the masks, set --num_classes, or set "
            f"--mask_values to the values that are classes"
        )
    masks = sum(len(split_sizes) for split_sizes in sizes)
    if inferred and (len(values) > 32 or (found[rare][0] == 1 and masks >= 20)):
        # Inferred classes: a value in a single mask, or dozens of values (antialiased or JPEG
        # masks), is more likely a broken mask than a class.
        raise DataError(
            f"the masks hold {len(values)} values ({shown}); the rarest, {rare}, is in "
            f"{found[rare][0]} of {masks} masks, such as {found[rare][1]}: fix the masks, set "
            f"--mask_values to the values that are classes, or --num_classes {len(values)} to "
            f"keep them all"
        )
    if image_size:
        return values, num_classes, tuple(image_size)
    if bucket_by_size:
        return values, num_classes, None  # every image keeps its own size
    distinct = sorted({size for split_sizes in sizes for size in split_sizes})
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[:2]
        raise DataError(
            f"images have different sizes ({w1}x{h1}, {w2}x{h2}): set --image_size to resize "
            f"them, or --bucket_by_size true to train on each at its own size"
        )
    ((h, w),) = distinct
    if min(w, h) < min_size:
        raise DataError(
            f"images are {w}x{h}, smaller than {min_size} pixels (crop_size, or the model's "
            f"smallest input): set --image_size"
        )
    return values, num_classes, (h, w)


def decode_pair(pairs, i, values, mode, size=None):
    """Pair i of `pairs` as uint8 tensors: the image in PIL `mode` [C, H, W] and its class
    indices [H, W] (int64 past 256 classes), resized to `size` (height, width) if given, the
    mask by nearest neighbour. A DataError names a file that fails."""
    # Here, not at the top: torchvision loads torch's compiler (over 1 s), which --help skips.
    from torchvision.transforms.v2.functional import InterpolationMode, pil_to_tensor, resize

    image, mask_values, name = pairs[i]
    try:
        image = image.convert(mode)  # decodes an image file: the scan read only its header
    except IMAGE_ERRORS as e:  # such as a truncated file
        raise unreadable_image(getattr(image, "filename", "") or name, e) from None
    lut = np.zeros(
        max(max(values), int(mask_values.max())) + 1,
        np.uint8 if len(values) <= 256 else np.int64,
    )
    lut[values] = np.arange(len(values))  # the scan made sure that no other value occurs
    image, classes = pil_to_tensor(image), torch.from_numpy(lut[mask_values])
    if size is not None and tuple(classes.shape) != tuple(size):
        image = resize(image, list(size), antialias=True)
        classes = resize(classes[None], list(size), InterpolationMode.NEAREST)[0]
    return image, classes


def decode_all(pairs, values, mode, size, threads):
    """Every pair decoded once by decode_pair() on `threads` threads: (images, masks), two
    stacked tensors when `size` is given, else two lists. The first bad file in order stops it,
    so every process that decodes the same pairs says the same."""
    n = len(pairs)
    if size is None:
        images, masks = [None] * n, [None] * n
    else:
        images = torch.empty(n, len(mode), *size, dtype=torch.uint8)  # a band per letter: RGB 3
        masks = torch.empty(n, *size, dtype=torch.uint8 if len(values) <= 256 else torch.int64)

    def put(i):
        images[i], masks[i] = decode_pair(pairs, i, values, mode, size)

    with ThreadPoolExecutor(threads) as pool:  # PIL and resize let go of the GIL while they work
        for _ in pool.map(put, range(n)):  # raises the first failure in order
            pass
    return images, masks


def padded(n, multiple):
    return -(-n // multiple) * multiple


def pad_collate(batch, multiple):
    """(image, mask) pairs of different sizes -> one batch, padded to its largest height and
    width (rounded up to `multiple`): images with 0, masks with IGNORE."""
    height, width = (padded(max(mask.shape[d] for _, mask in batch), multiple) for d in (0, 1))
    return (
        torch.stack([pad_to(image, height, width, 0) for image, _ in batch]),
        torch.stack([pad_to(mask, height, width, IGNORE) for _, mask in batch]),
    )


class SegmentationSet(Dataset):
    """Whole batches, read a batch at a time (`__getitems__`): uint8 images [N, C, H, W] and
    int64 class indices [N, H, W], and for training (`randoms`) rand [N, RANDOMS]: per sample,
    uniform numbers seeded with (seed, epoch, sample index), for the recipe's augmentation.
    The images come from `cache` (decode_all, on any device: a batch is gathered there), or are
    decoded from `pairs` at every read, in DataLoader workers. `pad`: images of different sizes,
    padded per batch to a multiple of `pad` (pad_collate). `epoch` lives in shared memory, so
    persistent workers see the recipe set it before each epoch."""

    def __init__(self, pairs, values, mode, size, *, seed, randoms, cache=None, pad=0):
        self.pairs, self.values, self.mode, self.size = pairs, values, mode, size
        self.seed, self.with_randoms, self.cache, self.pad = seed, randoms, cache, pad
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self):
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value):
        self._epoch.fill_(value)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return tuple(part[0] for part in self.__getitems__([i]))

    def __getitems__(self, indices):
        if self.cache is None:
            pairs = [decode_pair(self.pairs, i, self.values, self.mode, self.size) for i in indices]
        elif self.pad:  # a list of images of their own sizes
            pairs = [(self.cache[0][i], self.cache[1][i]) for i in indices]
        else:  # one gather per tensor, where the cache is
            index = to_device(torch.as_tensor(indices), self.cache[0].device)
            images = self.cache[0].index_select(0, index)
            masks = self.cache[1].index_select(0, index).long()
        if self.cache is None or self.pad:
            pairs = [(image, mask.long()) for image, mask in pairs]
            if self.pad:
                images, masks = pad_collate(pairs, self.pad)
            else:
                images, masks = map(torch.stack, zip(*pairs))
        if not self.with_randoms:
            return images, masks
        return images, masks, self.randoms(indices)

    def randoms(self, indices):
        """[len(indices), RANDOMS] uniform numbers in [0, 1), each row from its sample's seed."""
        gen, base = torch.Generator(), (self.seed * 1_000_003 + self.epoch) * 1_000_003
        return torch.stack(
            [torch.rand(RANDOMS, generator=gen.manual_seed(base + i)) for i in indices]
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
    batch: object  # for describe(): the batch size, or what a bucketed batch holds
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


def decoded(pairs, values, mode, size, *, threads, device, cache_decoded):
    """decode_all() of the pairs, once: for a fixed size through common.cache (cache_decoded),
    keyed by the pairs' identity() and by the code that reads and decodes them, so a later run
    on the same files and code reads a file instead; then onto `device`."""
    if size is None:  # images of their own sizes: a list per split, decoded every run
        images, masks = decode_all(pairs, values, mode, size, threads)
        return [t.to(device) for t in images], [t.to(device) for t in masks]
    key = ["segmentation", pairs.identity(), values, mode, list(size)]
    code = (type(pairs).__getitem__, decode_pair)
    images, masks = cached_tensors(
        key,
        lambda: decode_all(pairs, values, mode, size, threads),
        code=code,
        enabled=cache_decoded,
    )
    return images.to(device), masks.to(device)


def load_segmentation(
    train_pairs,
    val_pairs,
    *,
    accelerator,
    values,
    fixed,
    num_classes,
    in_channels,
    image_size,
    bucket_by_size,
    max_batch_pixels,
    cache_images,
    cache_decoded,
    batch_size,
    eval_batch_size,
    seed,
    num_workers,
    pad_multiple,
    min_size,
):
    """Check every mask on all processes, then build the training and validation loaders: plain
    ones for accelerator.prepare() to shard, or with bucket_by_size, bucketed ones that are
    sharded and on the device already (do not prepare them).
    values: the classes' mask values in order, or None for those found; `fixed`: where given
    values come from, for messages (--mask_values, a weights file). image_size: (h, w) or None.
    cache_images: True, False or None (auto: if it fits CACHE_BUDGET_GB): each process decodes
    all images once onto its device (a GPU's memory is its own) and gathers its batches there,
    with no workers; cache_decoded: keep those decoded tensors on disk for later runs.
    pad_multiple: padded sides are multiples of it; min_size: the model's smallest side."""
    require_one_batch_per_process(len(train_pairs), batch_size, accelerator, "the training data")
    found, sizes, modes = scan_pairs(accelerator, [train_pairs, val_pairs])
    values, num_classes, input_size = classes_and_size(
        found,
        sizes,
        values=values,
        num_classes=num_classes,
        fixed=fixed,
        image_size=image_size,
        bucket_by_size=bucket_by_size,
        min_size=min_size,
    )
    channels = channels_of_data(in_channels, modes)
    mode = MODES[channels]
    pixels = sum(h * w for split_sizes in sizes for h, w in split_sizes)
    if input_size is not None:
        pixels = sum(map(len, sizes)) * input_size[0] * input_size[1]
    size_gb = (channels + 1) * pixels / 2**30  # uint8 channels and one byte of class per pixel
    cached = size_gb <= CACHE_BUDGET_GB if cache_images is None else cache_images
    device = accelerator.device
    workers = 0 if cached else worker_count(num_workers, accelerator.num_processes)
    if cached:
        reading = f"images decoded once, {size_gb * 1024:.0f} MB in {device.type} memory"
    else:
        where = f"by {workers} DataLoader worker(s) per" if workers else "in the training"
        reading = f"images decoded at every read {where} process"

    def dataset(pairs, train):
        cache = None
        if cached:
            threads = cpus_per_process(accelerator.num_processes)
            cache = decoded(
                pairs,
                values,
                mode,
                input_size,
                threads=threads,
                device=device,
                cache_decoded=cache_decoded,
            )
        pad = pad_multiple if bucket_by_size else 0
        return SegmentationSet(
            pairs, values, mode, input_size, seed=seed, randoms=train, cache=cache, pad=pad
        )

    train_set, val_set = dataset(train_pairs, True), dataset(val_pairs, False)
    pin = device.type == "cuda" and not cached  # non_blocking: the copy to the GPU does not wait
    known = (values, num_classes, input_size, channels)
    if not bucket_by_size:  # each loader with its own generator: see seeded_loader
        loaders = [
            seeded_loader(
                dataset,
                batch_size=size,
                shuffle=shuffle,
                seed=seed,
                num_workers=workers,
                pin_memory=pin,
            )
            for dataset, size, shuffle in (
                (train_set, batch_size, True),
                (val_set, eval_batch_size, False),
            )
        ]
        shape = f"{input_size[1]}x{input_size[0]}"
        return SegmentationData(*loaders, *known, 0, batch_size, shape, reading, cached)
    # A budget of padded pixels per batch; validation gets eval_batch_size / batch_size times more.
    train_sizes, val_sizes = (
        [(padded(h, pad_multiple), padded(w, pad_multiple)) for h, w in part] for part in sizes
    )
    budget = max_batch_pixels or batch_size * max(h * w for h, w in train_sizes)
    train = bucket_loader(
        train_set,
        train_sizes,
        budget,
        accelerator,
        train=True,
        seed=seed,
        collate_fn=tuple,
        num_workers=workers,
        pin_memory=pin,
    )
    val_budget = max(budget * eval_batch_size // batch_size, 1)
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
