"""ADAPT: the U-Net recipe's data, the part a copy changes for its own layout and masks:

    list_pairs(cfg)          which (image, mask) pairs make the training and validation splits
    read_pair(image, mask)   one pair as PIL images: the image, and its mask of values or colours
    mask_classes(cfg, ...)   which mask value is which class, and which count for nothing

Everything behind them, the same for any data, is common/segmentation_data.py: the mask scan
across processes, class and size checks, decoding (cached), per-sample seeded augmentation,
padding, bucketing and the loaders, all in one call, load_segmentation().
"""

from pathlib import Path

import torch
from PIL import Image

from common.config import require
from common.data import DataError, TableRows, load_splits, open_image
from common.segmentation_data import MaskClasses

SHAPES = "data/shapes"  # the default data, made by `make data/shapes` (scripts/make_shapes.py)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp"}


# ADAPT: your layout. Each split is a sequence of (image, mask, name): paths, or what a datasets
# row holds (PIL images), and a name for messages.
def list_pairs(cfg):
    """(train, validation) of a folder with imgs/ and masks/ (Carvana's layout: imgs/NAME.jpg
    with masks/NAME.png or masks/NAME_mask.gif), or of what datasets.load_dataset reads, with an
    image column and a mask column."""
    root = Path(cfg.dataset)
    if cfg.dataset == SHAPES and not root.exists():
        raise DataError(
            f"{root} does not exist yet: write it with `make data/shapes` or python "
            f"scripts/make_shapes.py"
        )
    if (root / "imgs").is_dir() and not (root / "masks").is_dir():
        raise DataError(
            f"{root} has imgs/ but no masks/: add masks/NAME.png or masks/NAME_mask.* for each "
            f"imgs/NAME.*"
        )
    if (root / "imgs").is_dir():
        pairs = folder_pairs(root)
        n_val = int(len(pairs) * cfg.val_fraction)
        if not 0 < n_val < len(pairs):
            raise DataError(
                f"val_fraction {cfg.val_fraction} of {len(pairs)} images leaves none to validate "
                f"or train"
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


# ADAPT: reading one pair. The image's pixels are decoded later, in the mode of the model's input
# channels; the mask's values are what mask_classes() lists: grey levels, palette indices or label
# ids, or for an RGB mask (CamVid's), one colour per class.
def read_pair(image, mask, name):
    """A PIL image and its mask, a PIL image of integer values or of RGB colours (an integer
    array [H, W], or [H, W, 3] of colours, does too). Both are decoded later: their pixels only
    when common/segmentation_data.py needs them, at the size it needs. A file PIL cannot open
    stops with a DataError naming it."""
    image, mask = (
        open_image(p, kind) if isinstance(p, Path) else p
        for p, kind in ((image, "image"), (mask, "mask"))
    )
    if not isinstance(mask, Image.Image):
        raise DataError(
            f"{name}: the mask is a {type(mask).__name__}, not an image: check mask_column"
        )
    if image.size != mask.size:
        raise DataError(
            f"mask {name} is {mask.width}x{mask.height}, its image {image.width}x{image.height}"
        )
    return image, mask


# ADAPT: which mask value is which class: class i is mask value values[i], and the pixels of the
# ignored values count for nothing. values None: one class per value found in the masks, in
# order (common/segmentation_data.py checks them either way). A preset for a dataset's labels,
# such as Cityscapes' ids, is a --config file: recipes/configs/cityscapes.yaml.
def mask_classes(cfg, stored=None):
    """--mask_values, --ignore_index and --ignore_unlisted, each else as the --weights file's
    record (`stored`) has it."""
    stored = stored or {"mask_values": None, "ignored": [], "ignore_unlisted": False}
    values = parse_values(cfg.mask_values, "--mask_values") if cfg.mask_values else None
    ignored = parse_values(cfg.ignore_index, "--ignore_index") if cfg.ignore_index else None
    return MaskClasses(
        values=values or stored["mask_values"],
        ignored=tuple(stored["ignored"] if ignored is None else ignored),
        unlisted_ignored=cfg.ignore_unlisted or stored["ignore_unlisted"],
    )


def parse_values(text, where):
    """'0,85,170' -> [0, 85, 170], and colours '#800000' -> 0x800000: distinct non-negative
    integers, or a ConfigError."""

    def value(v):
        v = v.strip()
        return int(v[1:], 16) if v.startswith("#") and len(v) == 7 else int(v)

    try:
        values = [value(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    require(
        values and min(values) >= 0 and len(set(values)) == len(values),
        f"{where} must be distinct non-negative integers or #rrggbb colours separated by commas, "
        f"like 0,255; got {text!r}",
    )
    return values


class Pairs:
    """One split's pairs, read when indexed: pairs[i] is read_pair() of the i-th listed pair,
    with its name. What load_segmentation() takes; `identity` keys the decoded-data cache."""

    def __init__(self, listed):
        self.listed = listed

    def __len__(self):
        return len(self.listed)

    def __getitem__(self, i):
        *pair, name = self.listed[i]
        return (*read_pair(*pair, name), name)

    def identity(self):
        """What fixes the pairs' contents, for the cache: each file's path, size and time of
        change, or the datasets split's fingerprint (derived from its files or hub revision)."""
        if isinstance(self.listed, TableRows):
            return [self.listed.ds._fingerprint, self.listed.columns]
        return [
            [str(p), (s := p.stat()).st_size, s.st_mtime_ns]
            for image, mask, _ in self.listed
            for p in (image, mask)
        ]
