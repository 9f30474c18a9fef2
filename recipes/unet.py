"""U-Net semantic segmentation: the classic model of Ronneberger et al., as in milesial/Pytorch-UNet.

    python scripts/make_shapes.py                                 # the default data, data/shapes
    python recipes/unet.py --epochs 10                            # one process
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/unet.py --dataset DIR --num_classes 2
    python recipes/unet.py --predict "photos/*.jpg" --weights runs/unet/model.safetensors --overlay

The same file runs on CPU, one GPU, many GPUs and fp16/bf16: the accelerate config decides.
Settings are the Config fields below: `--config run.yaml` and `--field value`. The `# ADAPT:`
comments mark what to change for your data.
"""

import glob
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
from accelerate.utils import broadcast, gather_object, set_seed
from PIL import Image
from safetensors import SafetensorError, safe_open
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor, resize
from tqdm.auto import tqdm

from common.checkpoint import (
    choose_checkpoint, load_checkpoint, load_weights, save_checkpoint, save_weights,
)
from common.config import UserError, require, save_config
from common.determinism import set_deterministic
from common.data import DataError, load_splits
from common.metrics import MetricsLog, Throughput, TrainLoss, peak_memory_mb
from common.sampler import bucket_loader
from common.runtime import (
    build_accelerator, close, describe, elastic_restart, make_output_dir, run, stop_requested, tracker,
)


@dataclass
class Config:
    # Data. ADAPT: a folder with imgs/ and masks/ (the Carvana layout: imgs/NAME.jpg with masks/NAME.png
    # or masks/NAME_mask.gif), or a hub name / folder that datasets.load_dataset reads.
    dataset: str = "data/shapes"  # `make data/shapes` writes it (scripts/make_shapes.py)
    val_fraction: float = 0.1  # imgs/+masks/ folders: share held out for validation, the same for every seed
    image_column: str = "image"  # datasets data: the column of images
    mask_column: str = "mask"  # datasets data: the column of masks
    train_split: str = "train"  # datasets data
    val_split: str = "validation"  # datasets data
    mask_values: str = ""  # mask pixel values in class order, e.g. "0,255"; empty: the sorted values found
    num_classes: int = 4  # classes with background; 1: one sigmoid output, for masks of 2 values
    output_dir: str = f"runs/{Path(__file__).stem}"  # runs/<file name>: config.yaml, metrics.jsonl, weights, checkpoints/
    # Model.
    base_channels: int = 64  # width of the first level, doubled at each of the 4 levels down
    bilinear: bool = False  # upsample by bilinear interpolation (fewer weights), not transposed convolutions
    sync_bn: bool = True  # BatchNorm statistics over all processes' batches (PyTorch has it on GPUs only)
    channels_last: bool = False  # NHWC memory layout: faster convolutions in fp16/bf16 on recent GPUs
    # Images of different sizes: train and evaluate each at its own size, in batches of similar sizes.
    bucket_by_size: bool = False  # batches padded to their largest image (padding ignored by loss and Dice)
    max_batch_pixels: int = 0  # bucket_by_size: padded pixels per training batch; 0: batch_size x the largest image
    # Augmentation: an image and its mask get the same resize, crop and flips (the mask by nearest neighbour).
    image_size: int = 0  # resize to image_size x image_size; 0: keep the files' size, which must all match
    crop_size: int = 0  # training only: a random square crop of this size after the resize; 0: no crop
    hflip: float = 0.5  # training only: probability of a horizontal flip
    vflip: float = 0.0  # training only: probability of a vertical flip
    # Training.
    epochs: int = 5
    batch_size: int = 8  # per process: the global batch is this x processes x accumulation steps
    eval_batch_size: int = 16  # per process; also predict's batch
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    scheduler: str = "cosine"  # cosine: to 0 at the end of the last epoch; plateau: x0.1 after 5 evals with no better dice
    grad_clip: float = 1.0  # clip the gradient norm to this; 0: no clipping
    gradient_accumulation_steps: int = 1  # optimizer step every N batches
    scale_lr: bool = False  # multiply lr by processes x accumulation steps (the linear scaling rule)
    seed: int = 0  # model init, data order and augmentation; same seed, same run
    deterministic: bool = False  # bit-repeatable GPU runs, slower; cudnn.benchmark when off (common/determinism.py)
    num_workers: int = 2  # DataLoader workers per process: images are decoded from disk at every read
    max_steps: int = 0  # stop after this many optimizer steps (0: train all epochs)
    # Checkpoints (output_dir/checkpoints/step-N): the full state, for an exact resume.
    checkpoint_every_steps: int = 0  # also write one every N optimizer steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # delete older ones
    resume: Optional[str] = None  # "latest" or a checkpoint folder; torchrun restarts go on from this job's last one
    # Logging (metrics.jsonl is always written).
    log_with: str = "none"  # none, tensorboard (pip install -r requirements-extras.txt) or wandb (pip install wandb)
    log_every: int = 20  # optimizer steps between logged training scalars; image panels at every evaluation
    # Modes.
    smoke: bool = False  # train smoke_steps steps of one epoch, then evaluate: for tests and CI
    smoke_steps: int = 5
    eval_only: bool = False  # evaluate `weights` (or the `resume` checkpoint) on the validation images and stop
    weights: Optional[str] = None  # model.safetensors (or a state_dict .pt) to start from
    predict: Optional[str] = None  # image file or glob: write masks with `weights`, whose file holds the model settings
    predict_dir: Optional[str] = None  # where predict writes NAME_mask.png; default output_dir/predictions
    overlay: bool = False  # predict: also write NAME_overlay.png, the image with the classes painted on it
    dist_timeout_s: int = 600  # a rank stuck this long in a collective stops the job
    debug: bool = False  # show full tracebacks for user errors

    def validate(self):
        require(self.epochs >= 1, f"epochs must be at least 1, got {self.epochs}")
        require(min(self.batch_size, self.eval_batch_size) >= 1, "batch_size and eval_batch_size must be at least 1")
        require(self.lr > 0 and self.weight_decay >= 0, "lr must be positive and weight_decay not negative")
        require(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be at least 1")
        require(self.num_workers >= 0, f"num_workers cannot be negative, got {self.num_workers}")
        require(self.smoke_steps >= 1, f"smoke_steps must be at least 1, got {self.smoke_steps}")
        require(0 < self.val_fraction < 1, f"val_fraction must be between 0 and 1, got {self.val_fraction}")
        require(min(self.num_classes, self.base_channels) >= 1, "num_classes and base_channels must be at least 1")
        require(self.scheduler in ("cosine", "plateau"), f"scheduler must be cosine or plateau, got {self.scheduler!r}")
        require(self.grad_clip >= 0, f"grad_clip cannot be negative, got {self.grad_clip}")
        require(0 <= self.hflip <= 1 and 0 <= self.vflip <= 1, "hflip and vflip are probabilities, from 0 to 1")
        for name in ("image_size", "crop_size"):
            require(getattr(self, name) == 0 or getattr(self, name) >= 32,
                    f"{name} must be 0 or at least 32: the U-Net halves the image 4 times")
        require(not self.image_size or self.crop_size <= self.image_size, "crop_size cannot exceed image_size")
        require(not self.bucket_by_size or not (self.image_size or self.crop_size),
                "bucket_by_size trains on the images' own sizes: leave image_size and crop_size at 0")
        require(self.max_batch_pixels >= 0, f"max_batch_pixels cannot be negative, got {self.max_batch_pixels}")
        if self.mask_values:
            require(len(parse_values(self.mask_values, "--mask_values")) == value_count(self.num_classes),
                    f"mask_values needs one value per class ({value_count(self.num_classes)} for num_classes "
                    f"{self.num_classes}), got {self.mask_values!r}")
        require(self.max_steps >= 0 and self.checkpoint_every_steps >= 0, "max_steps and checkpoint_every_steps cannot be negative")
        require(self.keep_checkpoints >= 1 and self.log_every >= 1, "keep_checkpoints and log_every must be at least 1")
        require(not (self.weights and self.resume), "weights and resume both load a model: pass one of them")
        require(not self.eval_only or self.weights or self.resume, "eval_only needs --weights FILE or --resume CHECKPOINT")
        require(not self.predict or self.weights, "predict needs weights: add --weights PATH/model.safetensors")
        require(not (self.predict and self.eval_only), "choose one of predict and eval_only")

    def limits(self):
        """(epochs, optimizer steps) the run trains for, counted from its start, also when resumed;
        smoke: smoke_steps steps of one epoch."""
        return (1, self.smoke_steps) if self.smoke else (self.epochs, self.max_steps or math.inf)


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


# ADAPT: your model. The classic U-Net: 4 levels down, 4 up, a skip connection at each level.
def double_conv(cin, cout, mid=None):
    mid = mid or cout
    return nn.Sequential(
        nn.Conv2d(cin, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
        nn.Conv2d(mid, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class Up(nn.Module):
    def __init__(self, cin, cout, bilinear):
        super().__init__()
        if bilinear:  # no weights in the upsampling: the convolutions halve the channels instead
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = double_conv(cin, cout, cin // 2)
        else:
            self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
            self.conv = double_conv(cin, cout)

    def forward(self, x, skip):
        x = self.up(x)
        dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]  # an odd size lost a pixel going down
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    def __init__(self, num_classes, base_channels=64, bilinear=False, in_channels=3):
        super().__init__()
        c = [base_channels * 2**i for i in range(5)]  # 64, 128, 256, 512, 1024
        f = 2 if bilinear else 1
        self.inc = double_conv(in_channels, c[0])
        self.downs = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), double_conv(c[i], c[i + 1] // (f if i == 3 else 1))) for i in range(4)
        )
        self.ups = nn.ModuleList(Up(c[i], c[i - 1] // (f if i > 1 else 1), bilinear) for i in (4, 3, 2, 1))
        self.outc = nn.Conv2d(c[0], num_classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)  # logits [N, num_classes, H, W]


# ADAPT: your data. Pairs are read from disk at every access (Carvana does not fit in memory;
# the workers hide the decoding). A source is a sequence of (image, mask, name) for messages.
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp"}


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
        row = self.ds[i]
        return row[self.columns[0]], row[self.columns[1]], f"{self.where} row {i}"


def open_sources(cfg):
    """The train and validation sources, from imgs/ + masks/ or from datasets."""
    root = Path(cfg.dataset)
    if cfg.dataset == Config.dataset and not root.exists():
        raise DataError(f"{root} does not exist yet: write it with `make data/shapes` or python scripts/make_shapes.py")
    if (root / "imgs").is_dir() and (root / "masks").is_dir():
        pairs = folder_pairs(root)
        n_val = int(len(pairs) * cfg.val_fraction)
        if not 0 < n_val < len(pairs):
            raise DataError(f"val_fraction {cfg.val_fraction} of {len(pairs)} images leaves none to validate or train")
        # A fixed generator, as in the anchor: the held-out images do not move with --seed.
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
        return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]
    splits = load_splits(cfg.dataset, [cfg.train_split, cfg.val_split], [cfg.image_column, cfg.mask_column])
    return [TableRows(splits[split], cfg, split) for split in (cfg.train_split, cfg.val_split)]


def read_pair(image, mask, name):
    """A PIL image and its mask as an integer array of pixel values (grey levels or palette indices)."""
    image, mask = (Image.open(p) if isinstance(p, Path) else p for p in (image, mask))
    if not isinstance(mask, Image.Image):
        raise DataError(f"{name}: the mask is a {type(mask).__name__}, not an image: check mask_column")
    values = np.asarray(mask.convert("L") if mask.mode == "1" else mask)
    if values.ndim == 3:  # a grey mask saved as RGB(A): keep one channel if the others agree
        if not (values[..., :3] == values[..., :1]).all():
            raise DataError(f"mask {name} is in colour: save one grey level or palette index per class")
        values = values[..., 0]
    if image.size != values.shape[::-1]:
        raise DataError(f"mask {name} is {values.shape[1]}x{values.shape[0]}, its image {image.width}x{image.height}")
    return image, values.astype(np.int64)


def scan_masks(accelerator, sources):
    """{mask value: [number of masks holding it, one of them]}, and per source the (height, width)
    of each image, in order.

    Each process reads its share of the pairs and the results are gathered, so a bad file stops
    every rank with the same one-line error (never one rank raising while the others wait).
    """
    found, sizes, problems = {}, {}, []
    items = [(s, i) for s, source in enumerate(sources) for i in range(len(source))]
    for s, i in items[accelerator.process_index :: accelerator.num_processes]:
        image, mask, name = sources[s][i]
        try:
            _, values = read_pair(image, mask, name)
        except (DataError, OSError, Image.DecompressionBombError) as e:  # OSError: a file PIL cannot read
            problems.append(str(e))
            continue
        sizes[s, i] = values.shape
        for v in np.unique(values).tolist():
            found.setdefault(v, [0, name])[0] += 1
    merged, all_sizes = {}, {}
    for rank_found, rank_sizes, rank_problems in gather_object([(found, sizes, problems)]):
        if rank_problems:
            raise DataError(rank_problems[0])
        all_sizes.update(rank_sizes)
        for v, (count, name) in rank_found.items():
            merged.setdefault(v, [0, name])[0] += count
    return merged, [[all_sizes[s, i] for i in range(len(source))] for s, source in enumerate(sources)]


def mask_values_and_size(cfg, found, sizes, stored_values):
    """Class i is mask value values[i]: from --mask_values, else the weights file, else the values found."""
    text = cfg.mask_values or stored_values
    values = parse_values(text, "mask_values") if text else sorted(found)
    unknown = sorted(set(found) - set(values))
    if unknown:
        raise DataError(f"mask {found[unknown[0]][1]} has value {unknown[0]}, which is not one of mask_values "
                        f"{','.join(map(str, values))}: fix the mask, or list the value in --mask_values")
    if len(values) != value_count(cfg.num_classes) and text:  # --mask_values itself was checked in validate()
        raise DataError(f"{cfg.weights} was trained on {len(values)} mask values ({text}), "
                        f"which does not fit num_classes {cfg.num_classes}: set --num_classes")
    if len(values) != value_count(cfg.num_classes):
        rare = min(values, key=lambda v: found[v][0])
        raise DataError(f"the masks hold {len(values)} values ({','.join(map(str, values[:8]))}) where num_classes "
                        f"{cfg.num_classes} expects {value_count(cfg.num_classes)}; the rarest, {rare}, is in "
                        f"{found[rare][0]} mask(s), such as {found[rare][1]}: fix the masks, set --num_classes, or "
                        f"set --mask_values to the values that are classes")
    if cfg.image_size:
        return values, (cfg.image_size, cfg.image_size)
    if cfg.bucket_by_size:
        return values, None  # every image keeps its own size
    distinct = sorted({size for source_sizes in sizes for size in source_sizes})
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[:2]
        raise DataError(f"images have different sizes ({w1}x{h1}, {w2}x{h2}): set --image_size to resize them, "
                        f"or --bucket_by_size true to train on each at its own size")
    ((h, w),) = distinct
    if min(w, h) < max(32, cfg.crop_size):
        raise DataError(f"images are {w}x{h}, smaller than crop_size or the U-Net's 32 pixels: set --image_size")
    return values, (h, w)


class SegmentationSet(Dataset):
    """(uint8 image [3, H, W], int64 class indices [H, W]) after the joint transforms.

    The random transforms of sample i in epoch e draw from a generator seeded with (seed, e, i):
    the same augmentation whatever the number of workers or processes, and after a resume.
    The recipe sets `epoch` before each epoch. It lives in shared memory, so persistent
    DataLoader workers (started once, not every epoch) see the new value too.
    """

    def __init__(self, source, values, transform, seed):
        self.source, self.values, self.transform, self.seed = source, values, transform, seed
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
        image, values = read_pair(*self.source[i])
        mask = np.zeros(values.shape, np.int64)
        for c, v in enumerate(self.values):  # scan_masks made sure that no other value occurs
            mask[values == v] = c
        image = tv_tensors.Image(pil_to_tensor(image.convert("RGB")))
        with torch.random.fork_rng(devices=[]):  # leave the global RNG (dropout, init) untouched
            # The CPU generator only: torch.manual_seed() would also queue a CUDA seeding, with a
            # stack trace, that took 0.4 ms per sample (most of the time of reading a sample).
            torch.default_generator.manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + i)
            image, mask = self.transform(image, tv_tensors.Mask(torch.from_numpy(mask)))
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)


def make_loaders(cfg, train_source, val_source, values, pin_memory=False):
    """Plain single-process DataLoaders; accelerator.prepare() shards and reshuffles them.
    pin_memory: training on a GPU (the prepared loader then copies batches without waiting for it)."""
    sized = [v2.Resize((cfg.image_size, cfg.image_size), antialias=True)] if cfg.image_size else []
    crop = [v2.RandomCrop(cfg.crop_size)] if cfg.crop_size else []
    train_tf = v2.Compose([*sized, *crop, v2.RandomHorizontalFlip(cfg.hflip), v2.RandomVerticalFlip(cfg.vflip)])
    val_tf = v2.Compose(sized) if sized else v2.Identity()
    # Each loader has its own generator, so starting an epoch does not draw from the global RNG
    # and a resumed run continues with the same random numbers as an uninterrupted one.
    def loader(source, transform, batch_size, shuffle):
        # persistent_workers: starting the workers every epoch costs seconds (the first batches wait).
        return DataLoader(SegmentationSet(source, values, transform, cfg.seed), batch_size, shuffle=shuffle,
                          num_workers=cfg.num_workers, persistent_workers=cfg.num_workers > 0,
                          pin_memory=pin_memory, generator=torch.Generator().manual_seed(cfg.seed))

    return loader(train_source, train_tf, cfg.batch_size, True), loader(val_source, val_tf, cfg.eval_batch_size, False)


IGNORE = -1  # the class of padded pixels: no loss, no Dice
PAD_MULTIPLE = 16  # bucketed batches are padded to a multiple of 16: the U-Net halves the image 4 times


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


def make_bucket_loaders(cfg, accelerator, train_source, val_source, values, sizes):
    """bucket_by_size: loaders of batches of similar-size images under a pixel budget, sharded
    and placed on the device by common/sampler.py, so they do not go through accelerator.prepare().
    The budget counts padded pixels; validation gets eval_batch_size / batch_size times more."""
    train_sizes, val_sizes = ([(padded(h), padded(w)) for h, w in source_sizes] for source_sizes in sizes)
    budget = cfg.max_batch_pixels or cfg.batch_size * max(h * w for h, w in train_sizes)
    train_tf = v2.Compose([v2.RandomHorizontalFlip(cfg.hflip), v2.RandomVerticalFlip(cfg.vflip)])
    train = bucket_loader(SegmentationSet(train_source, values, train_tf, cfg.seed), train_sizes, budget, accelerator,
                          train=True, seed=cfg.seed, collate_fn=pad_collate, num_workers=cfg.num_workers)
    val = bucket_loader(SegmentationSet(val_source, values, v2.Identity(), cfg.seed), val_sizes,
                        max(budget * cfg.eval_batch_size // cfg.batch_size, 1), accelerator, train=False,
                        collate_fn=pad_collate, num_workers=cfg.num_workers)
    return train, val, budget


def prepare_input(x, cfg):
    x = x.float() / 255
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x


def loss_per_image(logits, target, num_classes):
    """Cross-entropy (BCE for 1 class) + soft Dice loss over all classes, one value per image, in fp32.
    Pixels of class IGNORE (batch padding) count in neither."""
    logits = logits.float()
    valid = (target != IGNORE).float()
    pixels = valid.sum((1, 2)).clamp(min=1)
    target = target.clamp(min=0)
    if num_classes == 1:
        logits, target = logits[:, 0], target.float()
        ce = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * valid).sum((1, 2)) / pixels
        probs, onehot = logits.sigmoid()[:, None], target[:, None]
    else:
        ce = (F.cross_entropy(logits, target, reduction="none") * valid).sum((1, 2)) / pixels
        probs, onehot = logits.softmax(1), F.one_hot(target, num_classes).permute(0, 3, 1, 2).float()
    probs, onehot = probs * valid[:, None], onehot * valid[:, None]
    inter, total = (probs * onehot).sum((2, 3)), (probs + onehot).sum((2, 3))
    dice = (2 * inter + 1) / (total + 1)  # +1: a class absent from both scores 1, and stray pixels cost little
    return ce + 1 - dice.mean(1)


def dice_counts(logits, target, num_classes):
    """Per image and foreground class: |pred & true| and |pred| + |true|, from hard predictions;
    padded pixels (IGNORE) are in neither."""
    pred = (logits[:, 0] > 0).long() if num_classes == 1 else logits.argmax(1)
    pred = torch.where(target == IGNORE, 0, pred)
    classes = torch.arange(1, value_count(num_classes), device=pred.device)[:, None, None]
    pred, true = pred[:, None] == classes, target[:, None] == classes  # [N, foreground classes, H, W]
    return (pred & true).sum((2, 3)), pred.sum((2, 3)) + true.sum((2, 3))


# The settings that decide which batches each process trains on, and in which order: a checkpoint
# written mid-epoch resumes only with the same values (and the same number of processes).
DATA_ORDER = ("dataset", "train_split", "val_fraction", "seed", "batch_size", "gradient_accumulation_steps",
              "bucket_by_size", "max_batch_pixels")


def save(accelerator, cfg, progress, scheduler, values):
    """A checkpoint: Accelerate's state plus where we are in the data, the LR schedule, the classes."""
    state = {"recipe": "unet", "world_size": accelerator.num_processes, **{k: getattr(cfg, k) for k in DATA_ORDER},
             **progress, "scheduler": scheduler.state_dict(), "mask_values": values}
    return save_checkpoint(accelerator, Path(cfg.output_dir) / "checkpoints", progress["step"], state,
                           cfg.keep_checkpoints)


def make_optimizer(model, lr, cfg, accelerator):
    """AdamW with fused kernels: one update for all the weights instead of a Python loop over
    them (for the default U-Net on 2 CPU cores, 24 ms a step instead of 140). Not under fp16's
    GradScaler: a fused step is always called, so Accelerate could no longer tell a skipped one,
    which the schedule and the skip count rely on. None, not False, leaves torch its default."""
    fused = accelerator.device.type in ("cpu", "cuda") and accelerator.scaler is None
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=fused or None)


def fit_cosine(scheduler, cfg, progress, steps_per_epoch):
    """Make the cosine schedule reach 0 at the last optimizer step of the last epoch. max_steps
    does not shorten it: it only stops the run, which a resume continues on the same curve. A
    resume may change epochs, or the process count at an epoch end; the lr then moves onto the
    new curve at the current step. steps_per_epoch: this process's optimizer steps per epoch."""
    epochs, _ = cfg.limits()
    steps_left = (epochs - progress["epoch"] + 1) * steps_per_epoch - math.ceil(
        progress["batches_done"] / cfg.gradient_accumulation_steps)  # the rest of this epoch, then the later ones
    end = progress["step"] + steps_left
    # end_step is saved with the schedule's state: a resume with the same plan leaves it as it is.
    if steps_left > 0 and end != getattr(scheduler, "end_step", None):
        scheduler.end_step = end
        # The schedule counts the steps it was stepped on: fp16 steps that the scaler skipped are not among them.
        if scheduler.last_epoch + steps_left != scheduler.T_max:
            scheduler.T_max = scheduler.last_epoch + steps_left
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base_lr * (1 + math.cos(math.pi * scheduler.last_epoch / scheduler.T_max)) / 2


def train_one_epoch(model, loader, optimizer, scheduler, accelerator, cfg, progress, values):
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
            loss = loss_per_image(model(prepare_input(x, cfg)), y, cfg.num_classes).mean()
            accelerator.backward(loss if progress["batches_done"] < short_from else loss * group / short)
            if cfg.grad_clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
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
        # We step the cosine schedule ourselves, once per optimizer step: a prepared one steps
        # num_processes times per call, and its schedule would end early on N processes.
        if cfg.scheduler == "cosine" and not accelerator.optimizer_step_was_skipped:
            scheduler.step()
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
            save(accelerator, cfg, progress, scheduler, values)
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
def evaluate(model, loader, accelerator, cfg, panels=False):
    """Dice of hard predictions on the validation images, exact on any number of processes.

    The Dice of an image is the mean, over the foreground classes (all but class 0; the one class
    of a 1-class model), of 2 |pred & true| / (|pred| + |true|), where a class absent from both
    prediction and mask scores 1. `dice` is the mean over images. Each validation image counts
    exactly once:
    - a prepared loader pads the last batch so every rank gets one; gather_for_metrics drops
      that padding.
    - a bucketed loader (bucket_by_size) pads nothing, so ranks may get different numbers of
      batches: then nothing may wait on other ranks per batch. The unwrapped model runs (a DDP
      model syncs its buffers in forward), with rank 0's buffers broadcast once before the loop,
      sums stay local, and one reduce ends the loop.
    With `panels`, also returns image | prediction | truth panels of the main process's first
    batch, for the tracker.
    """
    # keep_torch_compile=False: the default re-points a compiled model at the bare one, taking
    # DDP out of the model that training goes on using (Accelerate 1.15). Autocast stays.
    net = accelerator.unwrap_model(model, keep_torch_compile=False) if cfg.bucket_by_size else model
    net.eval()
    if cfg.bucket_by_size:  # as DDP's forward would: every rank uses rank 0's BatchNorm statistics
        broadcast(list(net.buffers()))
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # dice sum, loss sum, images
    panel = None
    for x, y in loader:
        logits = net(prepare_input(x, cfg))
        if panels and panel is None:
            pred = (logits[:, 0] > 0).long() if cfg.num_classes == 1 else logits.argmax(1)
            colour = torch.tensor(np.vstack([(0, 0, 0), PALETTE]), device=x.device, dtype=torch.uint8)
            def paint(classes):
                return colour[classes.clamp(min=0) % len(colour)].permute(0, 3, 1, 2)
            panel = torch.cat([x[:4], paint(pred[:4]), paint(y[:4])], dim=3).float() / 255
        counts = (*dice_counts(logits, y, cfg.num_classes), loss_per_image(logits, y, cfg.num_classes))
        inter, total, loss = counts if cfg.bucket_by_size else accelerator.gather_for_metrics(counts)
        dice = torch.where(total == 0, 1.0, 2 * inter / total.clamp(min=1))
        totals[0] += dice.double().mean(1).sum()
        totals[1] += loss.double().sum()
        totals[2] += len(loss)
    if cfg.bucket_by_size:
        totals = accelerator.reduce(totals, "sum")
    dice_sum, loss_sum, images = totals.tolist()
    return {"dice": dice_sum / images, "eval_loss": loss_sum / images, "eval_samples": int(images)}, panel


def weights_metadata(path):
    """The settings that save_weights stored in a .safetensors file; {} for other files."""
    if Path(path).suffix != ".safetensors" or not Path(path).is_file():
        return {}  # load_weights reports a missing file
    try:
        with safe_open(path, "pt") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        raise UserError(f"cannot read weights file {path} ({e}): it is truncated or not a weights file") from None


PALETTE = np.array([(230, 25, 75), (60, 180, 75), (0, 130, 200), (255, 225, 25), (145, 30, 180), (70, 240, 240)])


def predict(cfg, accelerator):
    """A mask PNG per image, at the image's size, in the training masks' values; each process does a share."""
    meta = weights_metadata(cfg.weights)
    if "mask_values" not in meta:
        raise UserError(f"{cfg.weights} holds no U-Net settings: predict needs weights saved by this recipe")
    values, num_classes = parse_values(meta["mask_values"], "mask_values"), int(meta["num_classes"])
    model = UNet(num_classes, int(meta["base_channels"]), meta["bilinear"] == "True")
    load_weights(model, cfg.weights)
    model.to(accelerator.device).eval()
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
    lut = np.array(values, np.uint8 if max(values) < 256 else np.uint16)  # class index -> mask value
    # The model sees images as in training: resized to input_size, or at their own size (bucket_by_size),
    # padded like a training batch, one at a time.
    native = meta["input_size"] == "native"
    size = None if native else [int(s) for s in meta["input_size"].split(",")]
    batch_size = 1 if native else cfg.eval_batch_size
    with accelerator.split_between_processes(files) as mine:
        for start in range(0, len(mine), batch_size):
            paths = mine[start : start + batch_size]
            images = [Image.open(p).convert("RGB") for p in paths]
            if native:
                x = pad_to(pil_to_tensor(images[0]), padded(images[0].height), padded(images[0].width), 0)[None]
            else:
                x = torch.stack([resize(pil_to_tensor(im), size, antialias=True) for im in images])
            with torch.inference_mode(), accelerator.autocast():
                logits = model(x.to(accelerator.device).float() / 255)
            for path, image, lg in zip(paths, images, logits):
                if native:
                    lg = lg[:, : image.height, : image.width].float()
                else:
                    lg = F.interpolate(lg[None].float(), (image.height, image.width), mode="bilinear")[0]
                classes = ((lg[0] > 0).long() if num_classes == 1 else lg.argmax(0)).cpu().numpy()
                Image.fromarray(lut[classes]).save(out / f"{Path(path).stem}_mask.png")
                if cfg.overlay:
                    rgb = np.asarray(image, np.float32)
                    rgb = np.where(classes[..., None] > 0, 0.5 * rgb + 0.5 * PALETTE[(classes - 1) % len(PALETTE)], rgb)
                    Image.fromarray(rgb.astype(np.uint8)).save(out / f"{Path(path).stem}_overlay.png")
    accelerator.wait_for_everyone()
    accelerator.print(f"wrote {len(files)} masks (values {meta['mask_values']}) to {out}/")


def main(cfg):
    # 1. Runtime: processes and precision come from the accelerate config.
    out = make_output_dir(cfg.output_dir)
    accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed, cfg.dist_timeout_s,
                                    log_with=tracker(cfg.log_with), project_dir=out)
    set_seed(cfg.seed)
    # No cudnn.benchmark with bucket_by_size: it would time every new (batch, height, width)
    # shape; on an H100 that made the first epoch of 1,800 mixed-size images take 100 s.
    set_deterministic(cfg.deterministic, benchmark=not cfg.bucket_by_size)
    if cfg.predict:
        predict(cfg, accelerator)
        close(accelerator)
        return
    checkpoint = choose_checkpoint(cfg.resume, out / "checkpoints", cfg.eval_only, restarted=elastic_restart())
    if accelerator.is_main_process and not cfg.eval_only:  # eval_only keeps the training run's config
        save_config(cfg, out / "config.yaml")
    if cfg.resume == "latest" and not checkpoint:
        accelerator.print(f"resume latest: no checkpoint in {out / 'checkpoints'} yet, so training starts at step 0")
    metrics = MetricsLog(out / "metrics.jsonl", accelerator.is_main_process)
    accelerator.init_trackers("unet", config=asdict(cfg))  # TensorBoard or wandb, if log_with says so

    # 2. Data: every process finds the pairs (the datasets cache is locked, so one download serves
    # all, and bad data fails alike on every rank), reads a share of the masks, and learns all values.
    train_source, val_source = open_sources(cfg)
    if len(train_source) < cfg.batch_size * accelerator.num_processes:
        raise DataError(f"{len(train_source)} training images are fewer than one global batch ({cfg.batch_size} x "
                        f"{accelerator.num_processes} processes): lower batch_size")
    found, sizes = scan_masks(accelerator, [train_source, val_source])
    stored = weights_metadata(cfg.weights) if cfg.weights else {}
    for name in ("num_classes", "base_channels", "bilinear"):  # the model's shape: name the setting that differs
        if name in stored and stored[name] != str(getattr(cfg, name)):
            raise UserError(f"{cfg.weights} was trained with {name} {stored[name]}, not {getattr(cfg, name)}: "
                            f"add --{name} {stored[name]}")
    values, input_size = mask_values_and_size(cfg, found, sizes, stored.get("mask_values"))
    if cfg.bucket_by_size:
        train_loader, val_loader, budget = make_bucket_loaders(cfg, accelerator, train_source, val_source, values, sizes)
        shapes = f"their own sizes, in batches of at most {budget} padded pixels"
    else:
        train_loader, val_loader = make_loaders(cfg, train_source, val_source, values,
                                                pin_memory=accelerator.device.type == "cuda")
        shapes = f"{input_size[1]}x{input_size[0]}"

    # 3. Model, optimizer and schedule.
    model = UNet(cfg.num_classes, cfg.base_channels, cfg.bilinear)
    if cfg.weights:
        load_weights(model, cfg.weights)
    if cfg.sync_bn and accelerator.num_processes > 1 and accelerator.device.type != "cpu":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # Accelerate leaves BatchNorm per process
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    lr = cfg.lr * (accelerator.num_processes * cfg.gradient_accumulation_steps if cfg.scale_lr else 1)
    optimizer = make_optimizer(model, lr, cfg, accelerator)
    if cfg.bucket_by_size:  # the bucketed loaders are sharded already: prepare() would deal them out again
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    if cfg.scheduler == "cosine":  # its length, T_max, is set by fit_cosine() once a resume has said where we are
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)
    else:
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", factor=0.1, patience=5)
    if any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        norm = "SyncBatchNorm"
    elif accelerator.num_processes > 1:
        norm = f"BatchNorm per process ({'SyncBatchNorm needs GPUs' if cfg.sync_bn else 'sync_bn is off'})"
    else:
        norm = "BatchNorm"
    adamw = "fused AdamW" if optimizer.defaults["fused"] else "AdamW"
    accelerator.print(
        f"unet: {describe(accelerator, cfg.batch_size)}; {adamw} lr {lr:g}; {norm}; {len(train_loader.dataset)} train / "
        f"{len(val_loader.dataset)} validation images of {shapes}; classes: mask values "
        f"{','.join(map(str, values))}{' (one sigmoid output)' if cfg.num_classes == 1 else ''}; outputs to {out}/"
    )

    # 4. Resume: weights, optimizer, RNG of every rank, LR schedule, and the position in the data.
    progress = {"epoch": 1, "batches_done": 0, "step": 0, "best_dice": -1.0}
    if checkpoint:
        order = None if cfg.eval_only else {k: getattr(cfg, k) for k in DATA_ORDER}  # eval_only reads no batches
        state = load_checkpoint(accelerator, checkpoint, "unet", order)
        if state["mask_values"] != values:
            raise DataError(f"checkpoint {checkpoint} maps mask values {state['mask_values']}, this data "
                            f"{values}: set --mask_values to match, or start a new run")
        scheduler.load_state_dict(state["scheduler"])
        progress = {k: state[k] for k in progress}
        accelerator.print(f"resumed from {checkpoint} (epoch {progress['epoch']}, step {progress['step']})")
    if cfg.scheduler == "cosine":
        fit_cosine(scheduler, cfg, progress, math.ceil(len(train_loader) / cfg.gradient_accumulation_steps))
    # What predict needs to rebuild the model and write masks travels inside the weights file.
    settings = {"recipe": "unet", "mask_values": ",".join(map(str, values)), "num_classes": cfg.num_classes,
                "base_channels": cfg.base_channels, "bilinear": cfg.bilinear,
                "input_size": "%d,%d" % input_size if input_size else "native"}

    # 5. Train, evaluating after every epoch.
    epochs, max_steps = cfg.limits()
    result, interrupted = None, False
    while not cfg.eval_only and progress["epoch"] <= epochs and progress["step"] < max_steps:
        epoch = progress["epoch"]
        train_loader.set_epoch(epoch)  # a new order every epoch, the same on every rank
        train_loader.dataset.epoch = epoch  # and new augmentations
        loader = train_loader
        if progress["batches_done"]:  # resumed mid-epoch: skip what this epoch already trained on
            loader = accelerator.skip_first_batches(train_loader, progress["batches_done"])
        lr = optimizer.param_groups[0]["lr"]
        train, stop = train_one_epoch(model, loader, optimizer, scheduler, accelerator, cfg, progress, values)
        interrupted = stop and stop_requested(accelerator, 0)
        if interrupted:
            break
        result, panel = evaluate(model, val_loader, accelerator, cfg, panels=cfg.log_with != "none")
        if progress["batches_done"] == len(train_loader):  # the epoch is complete (max_steps may end it too)
            if cfg.scheduler == "plateau":
                scheduler.step(result["dice"])
            progress.update(epoch=epoch + 1, batches_done=0)
            if result["dice"] > progress["best_dice"]:
                progress["best_dice"] = result["dice"]
                save_weights(accelerator, model, out / "best.safetensors", {**settings, "epoch": epoch, **result})
            save(accelerator, cfg, progress, scheduler, values)
        metrics.write(epoch=epoch, step=progress["step"], world_size=accelerator.num_processes, lr=lr,
                      **train, **result)
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=progress["step"])
        if panel is not None:
            for t in accelerator.trackers:  # trackers exist on the main process only
                t.log_images({"eval/image_prediction_truth": panel.cpu()}, step=progress["step"])
        accelerator.print(
            f"epoch {epoch}: train loss {train['train_loss']:.4f}, dice {result['dice']:.4f} "
            f"({result['eval_samples']} images), {train['train_samples_per_s']:.0f} images/s"
        )

    if interrupted:
        accelerator.print(f"stopped at step {progress['step']}; continue with --resume latest")
    else:
        if result is None:  # eval_only, or a resumed run that had nothing left to train
            result, _ = evaluate(model, val_loader, accelerator, cfg)
            metrics.write(epoch=None, step=progress["step"], world_size=accelerator.num_processes,
                          weights=str(cfg.weights or checkpoint), **result)
        if not cfg.eval_only:
            save_weights(accelerator, model, out / "model.safetensors", settings)
        accelerator.print(f"dice {result['dice']:.4f} on {result['eval_samples']} validation images; outputs in {out}/")

    # 6. Exit cleanly: drop what holds the process group, then close it.
    del model, optimizer, scheduler, train_loader, val_loader
    close(accelerator)


if __name__ == "__main__":
    run(main, Config)
