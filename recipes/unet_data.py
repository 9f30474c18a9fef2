"""ADAPT: the U-Net recipe's data, the part a copy changes for its own layout and masks:

    list_pairs(cfg)          which (image, mask) pairs make the training and validation splits
    read_pair(image, mask)   one pair as PIL images: the image, and its mask of values or colours
    mask_classes(cfg, ...)   which mask value is which class, and which count for nothing

Everything behind them, the same for any data, is common/segmentation/data.py: the mask scan
across processes, class and size checks, decoding (cached), per-sample seeded augmentation,
padding, bucketing and the loaders, all in one call, load_segmentation().
"""

from pathlib import Path

from PIL import Image

from common.config import require
from common.data import DataError, TableRows, open_image
from common.segmentation import pairs  # ADAPT: with list_pairs()
from common.segmentation.data import MaskClasses, parse_values, read_class_names, value_count

SHAPES = "data/shapes"  # the default data, made by `make data/shapes` (scripts/make_shapes.py)


# ADAPT: your layout, if the flags cannot name it. Each split is a sequence of (image, mask, name):
# paths, or what a datasets row holds (PIL images), and a name for messages.
def list_pairs(cfg):
    """(train, validation): the images of --images with their masks in --masks (or --dataset's
    imgs/ and masks/, Carvana's layout), each mask named after its image by --mask_name, split
    by --val_images, --val_list or val_fraction; else the rows of what datasets.load_dataset
    reads, with an image column and a mask column (common/segmentation/pairs.py)."""
    root = Path(cfg.dataset)
    if (root / "imgs").is_dir() and not cfg.images and not (root / "masks").is_dir():
        raise DataError(
            f"{root} has imgs/ but no masks/: add masks/NAME.png or masks/NAME_mask.* for each "
            f"imgs/NAME.*, or name the folders with --images and --masks"
        )
    if cfg.images or (root / "imgs").is_dir():
        return pairs.folder_splits(
            cfg.images or root / "imgs",
            cfg.masks or root / "masks",
            mask_name=cfg.mask_name,
            val_images=cfg.val_images,
            val_masks=cfg.val_masks,
            train_list=cfg.train_list,
            val_list=cfg.val_list,
            val_fraction=cfg.val_fraction,
        )
    if cfg.dataset == SHAPES and not root.exists():
        raise DataError(
            f"{root} does not exist yet: write it with `make data/shapes` or python "
            f"scripts/make_shapes.py"
        )
    if root.is_dir() and not any(root.rglob("*.parquet")):  # a folder of another layout
        raise DataError(
            f"{root} is neither imgs/ with masks/ nor parquet files: {pairs.layout_hint(root)}"
        )
    return pairs.table_splits(
        cfg.dataset,
        [cfg.train_split, cfg.val_split],
        [cfg.image_column, cfg.mask_column],
        hint="use a folder with imgs/ and masks/, --images and --masks",
    )


def check_data_settings(cfg):
    """The one-line errors of the data's settings, as the recipe's Config checks them at start-up:
    the folders and how masks are named (list_pairs), and the classes (mask_classes)."""
    require(
        bool(cfg.images) == bool(cfg.masks),
        "--images and --masks go together: the folder of the images, and of their masks",
    )
    require(not cfg.images or cfg.dataset == SHAPES, "choose one of --dataset and --images")
    require(
        not cfg.val_images or cfg.images,
        "--val_images needs --images and --masks: the training images and their masks",
    )
    require(
        not cfg.val_masks or cfg.val_images,
        "--val_masks needs --val_images: the validation images whose masks it holds",
    )
    require(
        not cfg.mask_name or "{stem}" in cfg.mask_name,
        f"mask_name names a mask after its image's stem, like {{stem}}_mask.png; got "
        f"{cfg.mask_name!r}",
    )
    require(
        0 < cfg.val_fraction < 1, f"val_fraction must be between 0 and 1, got {cfg.val_fraction}"
    )
    require(cfg.num_classes >= 0, f"num_classes must be at least 0, got {cfg.num_classes}")
    names, listed = read_class_names(cfg.class_names) if cfg.class_names else (None, None)
    require(
        not (listed and cfg.mask_values),
        f"class_names {cfg.class_names} gives the mask values: leave out --mask_values",
    )
    if cfg.ignore_index:
        parse_values(cfg.ignore_index, "--ignore_index", listed and dict(zip(names, listed)))
    if cfg.mask_values:
        count = value_count(cfg.num_classes) if cfg.num_classes else None
        given = parse_values(cfg.mask_values, "--mask_values")
        require(
            count in (None, len(given)),
            f"mask_values needs one value per class ({count} for num_classes "
            f"{cfg.num_classes}), got {cfg.mask_values!r}",
        )


# ADAPT: reading one pair. The image's pixels are decoded later, in the mode of the model's input
# channels; the mask's values are what mask_classes() lists: grey levels, palette indices or label
# ids, or for an RGB mask (CamVid's), one colour per class.
def read_pair(image, mask, name):
    """A PIL image and its mask, a PIL image of integer values or of RGB colours (an integer
    array [H, W], or [H, W, 3] of colours, does too). Both are decoded later: their pixels only
    when common/segmentation/data.py needs them, at the size it needs. A file PIL cannot open
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
# order (common/segmentation/data.py checks them either way). A preset for a dataset's labels,
# such as Cityscapes' ids, is a --config file: recipes/configs/cityscapes.yaml.
def mask_classes(cfg, stored=None):
    """--mask_values, --ignore_index, --ignore_unlisted and --class_names, each else as the
    --weights file's record (`stored`) has it. A --class_names file that gives each class's
    value (CamVid's class_dict.csv) gives the values, and --ignore_index may name a class of it
    (Void), which then is no class."""
    stored = stored or {"mask_values": None, "ignored": [], "ignore_unlisted": False}
    names, listed = read_class_names(cfg.class_names) if cfg.class_names else (None, None)
    values = parse_values(cfg.mask_values, "--mask_values") if cfg.mask_values else listed
    by_name = dict(zip(names, listed)) if listed else None
    ignored = (
        parse_values(cfg.ignore_index, "--ignore_index", by_name) if cfg.ignore_index else None
    )
    if listed and ignored:  # a class of the file that is ignored is no class
        names = tuple(n for n, v in zip(names, listed) if v not in ignored)
        values = tuple(v for v in listed if v not in ignored)
    return MaskClasses(
        values=values or stored["mask_values"],
        ignored=tuple(stored["ignored"] if ignored is None else ignored),
        unlisted_ignored=cfg.ignore_unlisted or stored["ignore_unlisted"],
        names=names or stored.get("class_names"),
    )


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

    def files(self):
        """Each pair as [image, mask]: their paths, or a table's row (and no mask file)."""
        if isinstance(self.listed, TableRows):
            return [[f"{self.listed.where} row {i}", ""] for i in range(len(self.listed))]
        return [[str(image), str(mask)] for image, mask, _ in self.listed]

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
