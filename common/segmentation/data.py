"""Image and mask pairs for semantic segmentation, from the recipe's pairs to loaders, in one call:

    data = load_segmentation(train_pairs, val_pairs, accelerator=accelerator,
                             classes=MaskClasses(None, ignored=(255,)), batch_size=8, ...)
    data.train_loader    # batches (images, masks, rand): augment them per sample with rand
    data.val_loader      # batches (images, masks)
    data.classes, data.num_classes, data.in_channels, data.input_size, data.class_pixels

A split of pairs is a sequence whose item i is (PIL image, mask, name), read when indexed (the
recipe's Pairs). A mask is an integer array [H, W] of values (grey levels, palette indices, label
ids), or [H, W, 3] of RGB colours, one per class. MaskClasses says which value is which class and
which values count for nothing (IGNORE, as padding does). Images are decoded in the PIL mode of
the model's input channels (MODES), and masks become class indices: uint8 up to 255 classes (255
then stands for IGNORE), int32 beyond. Behind load_segmentation():
- every mask is scanned once, each process a share, and a bad one stops every rank with the same
  one-line error (scan_pairs); the scan is remembered between runs on the same files;
- the classes and each image's size are decided from the scan and the settings (choose_classes,
  target_sizes): image_size, scale (the aspect ratio kept), or each image's own size;
- decoding happens once into memory (and, between runs, through common.cache), or at every read
  in DataLoader workers; a JPEG that is to be made smaller decodes at reduced size (PIL's draft);
- each training sample gets its own uniform random numbers, seeded with (seed, epoch, sample):
  the same augmentation for any number of workers or processes, cached or not, and after a resume;
- images of different sizes are padded per batch (pad_collate, IGNORE in the masks), in batches of
  similar sizes under a pixel budget (common.sampler.bucket_loader).
"""

import csv
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from common.cache import cached_tensors, read_json, write_json
from common.checkpoint import read_record
from common.config import ConfigError, UserError, require, shell_flag
from common.data import (
    IMAGE_ERRORS,
    DataError,
    cpus_per_process,
    index_tensor,
    require_one_batch_per_process,
    seeded_loader,
    to_device,
    unreadable_image,
    worker_count,
)
from common.sampler import bucket_loader
from common.segmentation.augment import copy_paste

IGNORE = (
    -1
)  # the class of pixels that count for nothing (padding, ignored values): no loss, no metric
STORED_IGNORE = 255  # IGNORE in a uint8 class mask, which therefore holds up to 255 classes
RANDOMS = 16  # uniform random numbers per training sample that an augmentation gets (rand[n])
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # input channels -> the PIL mode images are read in
GREY_MODES = ("1", "L", "I", "I;16", "F")
ALPHA_MODES = ("RGBA", "LA", "PA")
CACHE_BUDGET_GB = 4  # cache_images auto: decode once if images and masks fit this, per process
# Inferred classes: a value with fewer interior pixels than this share of its pixels lies along
# the edges between other values, as interpolation and JPEG leave values, not as a class does.
EDGE_ONLY = 0.02
VOID = 255  # the void label of Pascal VOC and of Cityscapes' train ids


def pad_to(tensor, height, width, value):
    """[..., h, w] -> [..., height, width], filled with `value` at the bottom and right."""
    padding = (0, width - tensor.shape[-1], 0, height - tensor.shape[-2])
    return torch.nn.functional.pad(tensor, padding, value=value)


def value_count(num_classes):
    """How many mask values a model tells apart: a 1-class (sigmoid) model has two."""
    return 2 if num_classes == 1 else num_classes


def input_channels(mode):
    """The model's input channels for images of a PIL mode: grey 1, with alpha 4, else RGB's 3."""
    return 1 if mode in GREY_MODES else 4 if mode in ALPHA_MODES else 3


def mask_array(mask, name, size=None):
    """A mask, a PIL image or an array, as a numpy array: [H, W] of integer values, or [H, W, 3]
    of colours. size (height, width): a PIL mask is first resized to it by nearest neighbour,
    before its pixels become an array. A DataError names a mask that does not decode, or that
    holds no integers."""
    try:
        if isinstance(mask, Image.Image):
            if mask.mode in ("1", "LA"):
                mask = mask.convert("L")
            elif mask.mode in ("RGBA", "CMYK", "YCbCr", "LAB", "HSV"):
                mask = mask.convert("RGB")
            if size is not None and mask.size != (size[1], size[0]):
                mask = mask.resize((size[1], size[0]), Image.NEAREST)
        array = np.asarray(mask)
    except IMAGE_ERRORS as e:  # a truncated or broken mask file
        raise unreadable_image(name, e, "mask") from None
    if array.dtype.kind not in "iub":
        raise DataError(f"mask {name} holds {array.dtype} values: save one integer value per class")
    return array


def mask_codes(mask):
    """A mask array as integers [H, W]: its values, or for colours [H, W, 3(+)], 0xRRGGBB."""
    mask = np.asarray(mask)
    if mask.ndim == 3:
        rgb = mask[..., :3].astype(np.int32)
        return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    return mask


def show_value(value, colour):
    """A mask value as the settings take it: 255, or a colour as #rrggbb."""
    return f"#{value:06x}" if colour else str(value)


def show_values(values, colour, most=8):
    """Values (or names, with colour False) as a list of up to `most`, then how many in all."""
    shown = ",".join(
        str(v) if isinstance(v, str) else show_value(v, colour) for v in list(values)[:most]
    )
    return shown + (f",... ({len(values)} in all)" if len(values) > most else "")


def parse_value(text):
    """A mask value as the settings write it: 255, or a colour #rrggbb as 0xRRGGBB; else None."""
    text = text.strip()
    try:
        return int(text[1:], 16) if text.startswith("#") and len(text) == 7 else int(text)
    except ValueError:
        return None


def parse_values(text, where, names=None):
    """'0,85,170' -> [0, 85, 170], and colours '#800000' -> 0x800000: distinct non-negative
    integers, or a ConfigError. names: {class name: mask value}, for values given by name (an
    --ignore_index Void of a --class_names file that gives the values)."""
    values = [
        names[v.strip()] if names and v.strip() in names else parse_value(v)
        for v in str(text).split(",")
    ]
    ok = values and None not in values and min(values) >= 0 and len(set(values)) == len(values)
    by_name = f", or names of --class_names ({', '.join(names)})" if names else ""
    require(
        ok,
        f"{where} must be distinct non-negative integers or #rrggbb colours{by_name}, separated "
        f"by commas, like 0,255; got {text!r}",
    )
    return values


def read_class_names(text):
    """--class_names as (names, mask values or None), in class order. `text` is a list, such as
    road,car,sky or pet=1,background=2, or a file: a name a line (name=value too), or CSV rows
    name,value or name,r,g,b (CamVid's class_dict.csv; a header row is skipped). Where every
    class has a value (colours as 0xRRGGBB), they are the classes' mask values."""
    path = Path(text)
    if path.suffix.lower() in (".csv", ".txt") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"class_names file {path} does not exist: check --class_names")
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r and r[0].strip()]
        if len(rows[0]) > 1 and parse_value(rows[0][1]) is None:
            rows = rows[1:]  # a header, such as name,r,g,b
    else:
        rows = [[item] for item in str(text).split(",")]
    names, values = [], []
    for row in rows:
        cells = [c.strip() for c in (row[0].split("=", 1) if len(row) == 1 else row)]
        if len(cells) == 4 and None not in map(parse_value, cells[1:]):
            r, g, b = map(parse_value, cells[1:])
            cells = [cells[0], f"#{r:02x}{g:02x}{b:02x}"]
        names.append(cells[0])
        values.append(parse_value(cells[1]) if len(cells) == 2 else None)
    where = path if path.is_file() else repr(text)
    require(
        all(names) and len(set(names)) == len(names),
        f"class_names {where} must give distinct names, one per class; got {names}",
    )
    if all(v is None for v in values):
        return tuple(names), None
    require(
        None not in values and len(set(values)) == len(values),
        f"class_names {where} must give every class a distinct mask value (name,value or "
        f"name,r,g,b; values 0 or more, colours 0..255), or none",
    )
    return tuple(names), tuple(values)


@dataclass(frozen=True)
class MaskClasses:
    """Which mask value is which class: class i is values[i] (None: the values the masks hold, to
    be decided by choose_classes). The pixels of `ignored` values count for nothing (IGNORE), and
    with unlisted_ignored so do those of every value not in `values`. colour: the values are
    colours, as mask_codes() packs them."""

    values: tuple | None
    ignored: tuple = ()
    unlisted_ignored: bool = False
    colour: bool = False
    names: tuple | None = None  # a name per class (--class_names); None: none given

    @property
    def labels(self):
        """Each class's name, or where none was given its mask value as the settings take it."""
        return list(self.names or (show_value(v, self.colour) for v in self.values))

    def cache_key(self):
        """What decides the class masks: everything but the names."""
        return {k: v for k, v in asdict(self).items() if k != "names"}

    @property
    def dtype(self):
        """The torch dtype of stored class masks (uint8: STORED_IGNORE is IGNORE)."""
        return torch.uint8 if len(self.values) < STORED_IGNORE else torch.int32

    def classes_of(self, mask):
        """A mask (values or colours) as class indices [H, W], numpy, in the stored dtype."""
        codes = mask_codes(mask)
        stored = np.uint8 if self.dtype == torch.uint8 else np.int32
        ignore = STORED_IGNORE if stored == np.uint8 else IGNORE
        keys = np.array([*self.values, *self.ignored], np.int64)
        classes = np.array([*range(len(self.values)), *[ignore] * len(self.ignored)], stored)
        low, high = int(codes.min()), int(codes.max())
        if low >= 0 and max(high, int(keys.max())) < 2**16:  # a table of every value: fast
            table = np.full(max(high, int(keys.max())) + 1, ignore, stored)
            table[keys] = classes
            return table[codes]
        # Colours and large values: by binary search among the known values; any other value is
        # unlisted (the scan has made sure that it occurs only with unlisted_ignored).
        order = np.argsort(keys)
        keys, classes = keys[order], classes[order]
        at = np.searchsorted(keys, codes).clip(max=len(keys) - 1)
        return np.where(keys[at] == codes, classes[at], np.array(ignore, stored)).astype(stored)


def as_classes(stored):
    """Stored class masks (MaskClasses.dtype) as int64 class indices, IGNORE where ignored."""
    classes = stored.long()
    if stored.dtype == torch.uint8:
        classes.masked_fill_(stored == STORED_IGNORE, IGNORE)
    return classes


def mask_stats(codes):
    """{value: (pixels, interior pixels, edges)} of a mask's codes [H, W]. A pixel is interior
    when its 4 neighbours hold its value: the values of a class fill regions, those that
    interpolation or JPEG leave lie along edges. edges: the pairs of neighbouring pixels of two
    different values that have this value on one side; a void band (VOC's 255, the border of
    the Oxford-IIIT Pet's trimaps) is on one side of nearly every such pair."""
    inner = codes[1:-1, 1:-1]
    same = inner == codes[:-2, 1:-1]
    for neighbour in (codes[2:, 1:-1], codes[1:-1, :-2], codes[1:-1, 2:]):
        same &= inner == neighbour
    across, down = codes[:, :-1] != codes[:, 1:], codes[:-1] != codes[1:]
    ends = [codes[:, :-1][across], codes[:, 1:][across], codes[:-1][down], codes[1:][down]]
    ends = np.concatenate(ends)
    if codes.dtype.kind in "ub" and codes.dtype.itemsize <= 2:  # grey levels, palette indices
        pixels = np.bincount(codes.ravel())
        interior = np.bincount(inner[same], minlength=len(pixels))
        edges = np.bincount(ends, minlength=len(pixels))
        return {
            int(v): (int(pixels[v]), int(interior[v]), int(edges[v]))
            for v in np.flatnonzero(pixels)
        }
    values, pixels = np.unique(codes, return_counts=True)
    interior = dict(zip(*(x.tolist() for x in np.unique(inner[same], return_counts=True))))
    edges = dict(zip(*(x.tolist() for x in np.unique(ends, return_counts=True))))
    return {
        int(v): (int(n), interior.get(int(v), 0), edges.get(int(v), 0))
        for v, n in zip(values, pixels)
    }


GRID = 16  # where a class lies: its pixels in each cell of a GRID x GRID grid over the image


def where_counts(codes):
    """{value: pixels in each cell [GRID * GRID]} of a mask's codes [H, W]: where in the image each
    value lies, on a grid relative to the image's size (so masks of any size add up)."""
    height, width = codes.shape
    rows = np.arange(height) * GRID // height
    cols = np.arange(width) * GRID // width
    cells = (rows[:, None] * GRID + cols[None, :]).ravel()
    values, inverse = np.unique(codes.ravel(), return_inverse=True)
    counts = np.zeros((len(values), GRID * GRID), np.int64)
    np.add.at(counts, (inverse.ravel(), cells), 1)
    return {int(v): row for v, row in zip(values, counts)}


SHAPE_GRID = 15  # a class's shape: its bounding box on a grid of this many cells a side (odd)
SHAPE_SIDE = 128  # the shapes are read on masks of at most this many pixels a side (even)


def box_cell(offset, side):
    """The cell (of SHAPE_GRID) of a pixel at `offset` in a box `side` pixels long. With an odd
    number of cells no pixel lies on a border between two, so a pixel and its mirror image in
    the box lie in cells that mirror each other: a shape alike in a mirror has a grid alike."""
    return (2 * offset + 1) * SHAPE_GRID // (2 * side)


def box_lines(sides):
    """[len(sides), SHAPE_GRID]: of boxes `sides` pixels long, the pixels in each cell (box_cell):
    those at offsets from the first of cell i (the least d with (2d + 1) * SHAPE_GRID >=
    2 * side * i) to the first of cell i + 1."""
    starts = -((SHAPE_GRID - 2 * sides[:, None] * np.arange(SHAPE_GRID + 1)) // (2 * SHAPE_GRID))
    return np.diff(starts, axis=1)


def mirror_samples(side):
    """The pixels read along a side longer than SHAPE_SIDE: SHAPE_SIDE of them, spread evenly,
    each one's mirror image (side - 1 - i) among them, so that a mask read this way and its
    mirror image read this way mirror each other; all of a shorter side."""
    if side <= SHAPE_SIDE:
        return slice(None)
    half = (2 * np.arange(SHAPE_SIDE // 2) + 1) * side // (2 * SHAPE_SIDE)
    return np.concatenate([half, side - 1 - half[::-1]])


def shape_sums(codes):
    """{value: the share of each cell [SHAPE_GRID * SHAPE_GRID] of its bounding box that it fills}
    of a mask's codes [H, W]: each value's shape, whatever its size and place, so that a class's
    shapes in many masks add up to its mean shape (Scan.shapes, mirror_shapes). Read on
    SHAPE_SIDE pixels a side of a larger mask (mirror_samples): a mean shape needs no more."""
    codes = codes[mirror_samples(codes.shape[0])][:, mirror_samples(codes.shape[1])]
    if codes.dtype.kind in "ub" and codes.dtype.itemsize <= 2:  # no sort: as mask_stats
        values = np.flatnonzero(np.bincount(codes.ravel()))
        inverse = np.zeros(values[-1] + 1, np.int64)
        inverse[values] = np.arange(len(values))
        inverse = inverse[codes]
    else:
        values, inverse = np.unique(codes, return_inverse=True)
        inverse = inverse.reshape(codes.shape)
    cells, lines = 0, []
    for axis, side in enumerate(codes.shape):
        place = np.arange(side).reshape((-1, 1) if axis == 0 else (1, -1))
        present = np.zeros((len(values), side), bool)
        present[inverse, place] = True  # the rows (then the columns) that each value is on
        first, end = present.argmax(1), side - present[:, ::-1].argmax(1)
        # [values, side]: the cell of each row (column) in each value's box, read for each pixel
        cell = box_cell(np.arange(side) - first[:, None], (end - first)[:, None])
        cells = cells * SHAPE_GRID + cell[inverse, place]
        lines.append(box_lines(end - first))
    size = SHAPE_GRID * SHAPE_GRID
    filled = np.bincount((inverse * size + cells).ravel(), minlength=len(values) * size)
    area = lines[0][:, :, None] * lines[1][:, None, :]  # each box's pixels in each cell
    shares = filled.reshape(-1, size) / area.reshape(-1, size).clip(min=1)
    return {int(v): share for v, share in zip(values, shares)}


# The fields of Scan.values[v]: masks holding v, one of them, v's pixels, its interior pixels,
# its pixels in the first (training) split, the edges between two values that it is on, and the
# training masks holding v.
MASKS, NAME, PIXELS, INTERIOR, TRAIN_PIXELS, EDGES, TRAIN_MASKS = range(7)
NO_STATS = [0, "", 0, 0, 0, 0, 0]  # those of a value in no mask


@dataclass
class Scan:
    """What the scan of every pair found: values {mask value: [MASKS, NAME, PIXELS, INTERIOR,
    TRAIN_PIXELS, EDGES, TRAIN_MASKS]}, sizes: per split, (height, width) of each image in order,
    modes: {image mode: an image of that mode}, colour: the masks hold colours, palette: the colours
    (r, g, b, r, g, b, ...) of the masks' palette, if they are palette PNGs (VOC's), else None;
    where: {mask value: its training pixels in each cell of a grid on the image} (where_counts);
    shapes: {mask value: the sum over the training masks that hold it of its shape (shape_sums)}."""

    values: dict
    sizes: list
    modes: dict
    colour: bool
    palette: list | None = None
    where: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)

    def to_json(self):
        return {
            **asdict(self),
            "values": [[v, *stats] for v, stats in self.values.items()],
            "where": [[v, *cells] for v, cells in self.where.items()],
            "shapes": [[v, *cells] for v, cells in self.shapes.items()],
        }

    @classmethod
    def from_json(cls, stored):
        values = {entry[0]: entry[1:] for entry in stored["values"]}
        sizes = [[tuple(size) for size in split] for split in stored["sizes"]]
        where = {entry[0]: entry[1:] for entry in stored["where"]}
        shapes = {entry[0]: entry[1:] for entry in stored["shapes"]}
        return cls(
            values, sizes, stored["modes"], stored["colour"], stored["palette"], where, shapes
        )


def scan_share(accelerator, splits):
    """This process's share of the scan: (values, sizes, modes, mask kinds, palette, where,
    shapes, problems)."""
    found, sizes, modes, kinds, palette, where, shapes, problems = {}, {}, {}, {}, None, {}, {}, []
    items = [(s, i) for s, split in enumerate(splits) for i in range(len(split))]
    for s, i in items[accelerator.process_index :: accelerator.num_processes]:
        try:
            image, mask, name = splits[s][i]
            if palette is None and getattr(mask, "mode", None) == "P":
                palette = mask.getpalette()
            mask = mask_array(mask, name)
        except (DataError, OSError, Image.DecompressionBombError) as e:  # OSError: PIL's
            problems.append(str(e))
            continue
        codes = mask_codes(mask)
        sizes[s, i] = codes.shape
        modes.setdefault(image.mode, getattr(image, "filename", "") or name)
        kinds.setdefault("colour" if mask.ndim == 3 else "grey", name)
        for v, (pixels, interior, edges) in mask_stats(codes).items():
            stats = found.setdefault(v, [0, name, 0, 0, 0, 0, 0])
            stats[MASKS] += 1
            stats[TRAIN_MASKS] += s == 0
            stats[PIXELS] += pixels
            stats[INTERIOR] += interior
            stats[TRAIN_PIXELS] += pixels if s == 0 else 0
            stats[EDGES] += edges
        if s == 0:
            add_up(where, where_counts(codes))
            add_up(shapes, shape_sums(codes))
    return found, sizes, modes, kinds, palette, where, shapes, problems


def add_up(sums, more):
    """sums {value: an array} += more {value: an array of the same length}."""
    for v, cells in more.items():
        sums[v] = sums[v] + cells if v in sums else cells


def scan_pairs(accelerator, splits, *, remember=False):
    """The Scan of every pair of `splits`. Each process reads its share of the pairs and the
    results are gathered, so a bad file stops every rank with the same one-line error (never one
    rank raising while the others wait). remember: keep the result under the datasets cache,
    keyed by the splits' identity() (each file's path, size and time of change) and by the code
    that reads the pairs, so that a later run on the same files reads it instead."""
    key = ["mask scan", [split.identity() for split in splits]] if remember else None
    code = [type(splits[0]).__getitem__, scan_share, mask_stats, where_counts, shape_sums, Scan]
    stored = read_json(key, code=code) if remember else None
    if all(gather_object([stored is not None])):  # every rank has it, or all scan
        return Scan.from_json(stored)
    values, all_sizes, modes, kinds, palette, where, shapes = {}, {}, {}, {}, None, {}, {}
    for (
        found_at,
        sizes_at,
        modes_at,
        kinds_at,
        palette_at,
        where_at,
        shapes_at,
        problems_at,
    ) in gather_object([scan_share(accelerator, splits)]):
        if problems_at:
            raise DataError(problems_at[0])
        add_up(where, where_at)
        add_up(shapes, shapes_at)
        all_sizes.update(sizes_at)
        modes = {**modes_at, **modes}
        kinds = {**kinds_at, **kinds}
        palette = palette or palette_at
        for v, stats in found_at.items():
            merged = values.setdefault(v, [0, stats[NAME], 0, 0, 0, 0, 0])
            for stat in (MASKS, PIXELS, INTERIOR, TRAIN_PIXELS, EDGES, TRAIN_MASKS):
                merged[stat] += stats[stat]
    if len(kinds) > 1:
        raise DataError(
            f"mask {kinds['colour']} is in colour, mask {kinds['grey']} holds grey levels or "
            f"palette indices: save all masks alike"
        )
    sizes = [[all_sizes[s, i] for i in range(len(split))] for s, split in enumerate(splits)]
    where = {v: [int(n) for n in cells] for v, cells in sorted(where.items())}
    shapes = {v: [round(float(x), 4) for x in cells] for v, cells in sorted(shapes.items())}
    scan = Scan(
        dict(sorted(values.items())), sizes, modes, "colour" in kinds, palette, where, shapes
    )
    if remember and accelerator.is_main_process:
        write_json(key, scan.to_json(), code=code)
    return scan


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


def choose_classes(scan, asked, *, num_classes, fixed):
    """(MaskClasses, num_classes, notes): the classes that `asked` lists (fixed: where they come
    from, for messages: --mask_values or a weights file; "" for those of a --class_names file that
    gives each class's value, as CamVid's class_dict.csv does), or those the masks hold, checked
    against the masks and num_classes (0: the number of values). notes: lines for the start-up,
    such as a value that looks like a void label (void_notes), unless `fixed`."""
    found, colour = scan.values, scan.colour
    ignored = set(asked.ignored)
    given = asked.values is not None
    both = sorted(ignored & set(asked.values or ()))
    if both:
        raise DataError(
            f"mask value {show_value(both[0], colour)} is both a class (mask_values) and ignored "
            f"(ignore_index): keep it in one of them"
        )
    if asked.unlisted_ignored and not given:
        raise DataError(
            "ignore_unlisted needs --mask_values: the values that are classes, in class order"
        )
    present = [v for v in found if v not in ignored]
    values = list(asked.values) if given else present
    shown = show_values(values, colour)
    unknown = sorted(set(present) - set(values))
    if unknown and not asked.unlisted_ignored:
        v = show_value(unknown[0], colour)
        raise DataError(
            f"mask {found[unknown[0]][NAME]} has value {v}, which is not one of mask_values "
            f"{show_values(values, colour, most=len(values))}: fix the mask, list the value in "
            f"--mask_values, or leave it out with {shell_flag('ignore_index', v)}"
        )
    if len(values) < 2:
        only = show_value(values[0], colour) if values else "(every value ignored)"
        raise DataError(
            f"every mask holds only the value {only}: a model needs a background and at "
            f"least one class; check the masks, or set --mask_values"
        )
    inferred = not (num_classes or given)
    num_classes = num_classes or len(values)
    if len(values) != value_count(num_classes) and given:
        raise DataError(
            f"{fixed or '--class_names'} gives {len(values)} mask values, which does not fit "
            f"num_classes {num_classes}: set --num_classes"
        )
    rare = min(values, key=lambda v: found.get(v, [0])[MASKS])
    if len(values) != value_count(num_classes):
        raise DataError(
            f"the masks hold {len(values)} values ({shown}) where num_classes {num_classes} "
            f"expects {value_count(num_classes)}; the rarest, {show_value(rare, colour)}, is in "
            f"{found[rare][MASKS]} mask(s), such as {found[rare][NAME]}: fix the masks, set "
            f"--num_classes, or set --mask_values to the values that are classes"
        )
    masks = sum(map(len, scan.sizes))
    edges = [v for v in values if inferred and found[v][INTERIOR] < EDGE_ONLY * found[v][PIXELS]]
    # One odd value in a single mask of many is more likely a broken mask than a class; several
    # values along the edges are what lossy masks hold.
    if inferred and found[rare][MASKS] == 1 and masks >= 20 and len(edges) < 2:
        raise DataError(
            f"the masks hold {len(values)} values ({shown}); the rarest, "
            f"{show_value(rare, colour)}, is in 1 of {masks} masks, such as {found[rare][NAME]}: "
            f"fix the masks, set --mask_values to the values that are classes, or --num_classes "
            f"{len(values)} to keep them all"
        )
    if edges:
        v = edges[0]
        raise DataError(
            f"the masks hold {len(values)} values ({shown}), and {len(edges)} of them, such as "
            f"{show_value(v, colour)} in {found[v][NAME]}, lie only along the edges between "
            f"others, as resizing with interpolation or saving as JPEG leaves them: save the "
            f"masks as PNG, resized by nearest neighbour, or set --mask_values to the values "
            f"that are classes"
        )
    names = asked.names
    if names is not None and len(names) != len(values):
        raise DataError(
            f"--class_names gives {len(names)} names for the {len(values)} classes (mask values "
            f"{shown}): give one name per class, in class order"
        )
    # Values listed one by one, or a weights file's, are chosen: a note could only contradict them.
    notes = [] if fixed else void_notes(found, values, colour, names=names if given else None)
    classes = MaskClasses(
        tuple(values), tuple(sorted(ignored)), asked.unlisted_ignored, colour, names
    )
    return classes, num_classes, notes


# Mirror twins (mirror_twins): where a class lies, mirrored, must match where its twin lies this
# well (the histogram intersection of the two, 0..1), and better than where the class itself lies
# by this margin: a class that lies anywhere, or in the middle, is its own mirror image.
TWIN_MATCH = 0.5
TWIN_MARGIN = 0.25


def mirror_twins(scan, classes):
    """[(i, j)]: the pairs of classes i < j that a horizontal flip turns into each other, as a
    left region and its right twin (a brain atlas's), from where each class lies in the training
    masks (Scan.where, on a grid): where i lies, mirrored left to right, matches where j lies
    best of all the classes, and the other way round, at least TWIN_MATCH, and better than it
    matches where the class itself lies by TWIN_MARGIN. Classes that lie anywhere (digits,
    letters: their shapes change in a mirror, their places do not) and classes in the middle
    (a car, a road) match themselves: no twins."""
    index = {v: i for i, v in enumerate(classes.values) if v in scan.where}
    if not index:
        return []
    values = list(index)
    share = np.array([scan.where[v] for v in values], np.float64)
    share /= share.sum(1, keepdims=True).clip(min=1)
    mirrored = share.reshape(len(values), GRID, GRID)[:, :, ::-1].reshape(len(values), -1)
    match = np.minimum(mirrored[:, None, :], share[None, :, :]).sum(2)  # [mirrored, other]
    itself = match.diagonal().copy()
    np.fill_diagonal(match, -1)
    best = match.argmax(1)
    twins = [
        (index[values[a]], index[values[b]])
        for a, b in enumerate(best)
        if best[b] == a
        and a < b
        and min(match[a, b], match[b, a]) >= TWIN_MATCH
        and match[a, b] - itself[a] >= TWIN_MARGIN
    ]
    return sorted(twins)


# Shapes a mirror changes (mirror_shapes): a class's mean shape and its mirror image differ by
# at least this share of its area (handwritten digits: 0.17 to 0.51; circles, boxes and
# triangles, whose mirror images are as common as they are: 0.06 at most), in at least this many
# training masks: chance alone differs by as much (the dev set's digits, each mirrored at random)
# for 9% of classes in 30 masks, 2% in 50, 0.2% in 100.
MIRROR_SHAPE = 0.15
MIRROR_MASKS = 100


def mirror_shapes(scan, classes, background):
    """[(i, difference)]: the classes whose shapes a horizontal flip changes, as it changes a
    digit's or a letter's, with how much: a class's shape in its bounding box, averaged over the
    training masks that hold it (Scan.shapes), against that mean's mirror image; their
    difference is the share of the mean's area that does not match, 0 when it is its own mirror
    image. A class's own shapes vary, and a mirror changes each, but only a class whose shapes
    lean one way keeps the difference in the mean. The classes judged: those (background
    aside) in MIRROR_MASKS training masks or more. Empty unless half or more of those judged
    differ by MIRROR_SHAPE or more: a class or two of natural data that lean one way by chance
    (a road's side in a country that drives on one side) leave the flips on."""
    judged = [
        (i, np.array(scan.shapes[v]).reshape(SHAPE_GRID, SHAPE_GRID) / scan.values[v][TRAIN_MASKS])
        for i, v in enumerate(classes.values)
        if i != background and v in scan.shapes and scan.values[v][TRAIN_MASKS] >= MIRROR_MASKS
    ]
    changed = [(i, float(abs(mean - mean[:, ::-1]).sum() / (2 * mean.sum()))) for i, mean in judged]
    changed = [(i, round(d, 3)) for i, d in changed if d >= MIRROR_SHAPE]
    return changed if judged and 2 * len(changed) >= len(judged) else []


BAND_SHARE = 0.9  # a void band is on one side of at least this share of the edges between values
# The names that datasets give the class that counts for nothing (CamVid's Void, Cityscapes'
# unlabeled), in lower case.
VOID_NAMES = ("void", "unlabeled", "unlabelled", "ignore", "ignored")


def void_name(names):
    """The first of `names` that is a void class's name (VOID_NAMES, in any case), or None."""
    return next((n for n in names or () if n.strip().lower() in VOID_NAMES), None)


def void_notes(found, values, colour, names=None):
    """A start-up note for a value found among the classes that looks like a void label: one
    that lies along the edges between the others, as Pascal VOC's 255 and the border (3) of the
    Oxford-IIIT Pet's trimaps do (on BAND_SHARE or more of the edges between two values, and on
    average at most 8 pixels wide: pixels <= 4 x edges, as a band has 2 edges along its length),
    or VOC's 255 beside small values, or a class named as a void class is (void_name). names:
    the classes' names where a --class_names file gave them with their values: the note then
    names the class as --ignore_index takes it (Void)."""
    edges = sum(stats[EDGES] for stats in found.values()) / 2  # each edge is on two values
    band = [
        v
        for v in values
        if len(values) >= 3
        and v in found  # a class of a --class_names file may be in no mask
        and found[v][EDGES] >= BAND_SHARE * edges
        and found[v][PIXELS] <= 4 * found[v][EDGES]
    ]
    others = [v for v in values if v != VOID]
    if band:
        v = band[0]
        why = (
            f"lies along the edges between the others (on {found[v][EDGES] / edges:.0%} of "
            f"them), as a void or unlabelled band does"
        )
    elif VOID in values and len(others) >= 2 and max(others) < 64:
        v = VOID
        why = (
            f"looks like a void label (the other values are {min(others)}..{max(others)}, as in "
            f"Pascal VOC)"
        )
    elif (named := void_name(names)) is not None:
        v, why = values[names.index(named)], "is named as a void label is"
    else:
        return []
    shown = show_value(v, colour)
    name = names[values.index(v)] if names else None
    return [
        f"note: mask value {shown}{f' ({name})' if name else ''} {why}, and is a class of its own "
        f"now: {shell_flag('ignore_index', name or shown)} leaves its pixels out of the loss and "
        f"the metrics"
    ]


def background_class(classes, class_pixels, asked=""):
    """The index of the background class: `asked` (a mask value as the settings take it, or a
    class's name), else the class that holds the most training pixels."""
    if not asked:
        return max(range(len(class_pixels)), key=class_pixels.__getitem__)
    labels = classes.labels
    shown = [show_value(v, classes.colour) for v in classes.values]
    for known in (labels, shown):
        if asked in known:
            return known.index(asked)
    raise DataError(
        f"--background {asked} is neither the mask value nor the name of a class (the classes: "
        f"{show_values(labels, False, most=len(labels))}): name one of them"
    )


def class_colours(scan, classes):
    """The dataset's own colour of each class, [[r, g, b], ...], where it has them: the colours
    of colour masks (CamVid's), or the palette of palette PNG masks (Pascal VOC's); else None."""
    if classes.colour:
        return [[(v >> 16) & 255, (v >> 8) & 255, v & 255] for v in classes.values]
    palette = scan.palette
    if palette and all(3 * v + 3 <= len(palette) for v in classes.values):
        return [palette[3 * v : 3 * v + 3] for v in classes.values]
    return None


def class_table(scan, classes):
    """Lines for the data check: each class (index, name, mask value), its share of the training
    masks' pixels and how many training masks hold it; then the ignored values, and the values
    no class has (ignore_unlisted)."""
    total = max(sum(stats[TRAIN_PIXELS] for stats in scan.values.values()), 1)
    named = classes.names is not None
    width = max(len(label) for label in classes.labels) + 2

    def row(head, value):
        stats = scan.values.get(value, NO_STATS)
        shown = show_value(value, classes.colour)
        return (
            f"{head:<{width + 4}}{shown:>10}{stats[TRAIN_PIXELS] / total:>17.2%}"
            f"{stats[TRAIN_MASKS]:>16}"
        )

    lines = [
        f"{'class':<{width + 4}}{'mask value':>10}{'training pixels':>17}{'training masks':>16}"
    ]
    for i, (label, value) in enumerate(zip(classes.labels, classes.values)):
        lines.append(row(f"{i:<3} {label if named else ''}", value))
    lines += [row("ignored", v) for v in classes.ignored if v in scan.values]
    known = {*classes.values, *classes.ignored}
    lines += [row("unlisted (ignored)", v) for v in scan.values if v not in known]
    return lines


def target_sizes(sizes, *, image_size, scale, bucket_by_size, min_size):
    """(per split, the (height, width) each image is decoded at; the input size that all share,
    or None with bucket_by_size: each its own). image_size (h, w): every image at it; scale: each
    at its own size times scale, truncated as milesial/Pytorch-UNet's --scale does (1918x1280
    at 0.5 is 959x640); neither: each at its own size. min_size: the model's smallest side."""

    def target(height, width):
        if image_size:
            return tuple(image_size)
        if scale:
            return max(int(height * scale), 1), max(int(width * scale), 1)
        return height, width

    targets = [[target(*size) for size in split] for split in sizes]
    if bucket_by_size:
        return targets, None
    distinct = sorted({size for split in targets for size in split})
    if len(distinct) > 1:
        (h1, w1), (h2, w2) = distinct[:2]
        raise DataError(
            f"images have different sizes ({w1}x{h1}, {w2}x{h2}): set --image_size to resize "
            f"them, or --bucket_by_size true to train on each at its own size"
        )
    ((h, w),) = distinct
    if min(w, h) < min_size:
        scaled = f" at scale {scale:g}" if scale else ""
        raise DataError(
            f"images are {w}x{h}{scaled}, smaller than {min_size} pixels (crop_size, or the "
            f"model's smallest input): set --image_size{', or a larger --scale' * bool(scale)}"
        )
    return targets, (h, w)


def nearest(mask, size):
    """A class mask [H, W] resized to `size` (height, width) by nearest neighbour, in any dtype."""
    (height, width), (h, w) = mask.shape, size
    rows = (torch.arange(h) * (height / h)).long().clamp(max=height - 1)
    cols = (torch.arange(w) * (width / w)).long().clamp(max=width - 1)
    return mask[rows[:, None], cols[None]]


def decode_pair(pairs, i, classes, mode, size):
    """Pair i of `pairs` as tensors: the image in PIL `mode`, uint8 [C, H, W], and its class
    indices [H, W] (MaskClasses.dtype), both at `size` (height, width): the image resized with
    antialiasing, the mask by nearest neighbour. A JPEG to be made smaller is decoded at reduced
    size first (PIL's draft: a half, a quarter or an eighth, never below `size`), which decodes
    several times faster. A DataError names a file that fails."""
    # Here, not at the top: torchvision loads torch's compiler (over 1 s), which --help skips.
    from torchvision.transforms.v2.functional import pil_to_tensor, resize

    image, mask, name = pairs[i]
    height, width = size
    try:
        if getattr(image, "format", None) == "JPEG" and height < image.height:
            image.draft(mode if mode in ("RGB", "L") else None, (width, height))
        image = image.convert(mode)  # decodes an image file: the scan read only its header
    except IMAGE_ERRORS as e:  # such as a truncated file
        raise unreadable_image(getattr(image, "filename", "") or name, e) from None
    mask = mask_array(mask, name, size)  # resized first: fewer pixels to map to classes
    image, target = pil_to_tensor(image), torch.from_numpy(classes.classes_of(mask))
    if tuple(image.shape[1:]) != (height, width):
        image = resize(image, [height, width], antialias=True)
    if tuple(target.shape) != (height, width):
        target = nearest(target, size)
    return image, target


def decode_all(pairs, classes, mode, sizes, threads, *, stack):
    """Every pair decoded once by decode_pair() at its size in `sizes`, on `threads` threads:
    (images, masks), two stacked tensors with `stack` (all of one size), else two lists. The
    first bad file in order stops it, so every process that decodes the same pairs says the
    same."""
    n = len(pairs)
    if stack:
        images = torch.empty(n, len(mode), *sizes[0], dtype=torch.uint8)  # RGB: 3 bands
        masks = torch.empty(n, *sizes[0], dtype=classes.dtype)
    else:
        images, masks = [None] * n, [None] * n

    def put(i):
        images[i], masks[i] = decode_pair(pairs, i, classes, mode, sizes[i])

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


class FirstPairs:
    """The first `count` pairs of a split (all, if it holds fewer), a split of its own: what
    overfit_batches trains and evaluates on."""

    def __init__(self, pairs, count):
        self.pairs, self.count = pairs, min(count, len(pairs))

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.pairs[i]

    def files(self):
        return self.pairs.files()[: self.count]

    def identity(self):
        return [self.pairs.identity(), self.count]


class SegmentationSet(Dataset):
    """Whole batches, read a batch at a time (`__getitems__`): uint8 images [N, C, H, W] and
    int64 class indices [N, H, W] (IGNORE where ignored or padded), and for training
    (`randoms`) rand [N, RANDOMS]: per sample, uniform numbers seeded with (seed, epoch, sample
    index), for the recipe's augmentation. The images come from `cache` (decode_all, on any
    device: a batch is gathered there), or are decoded from `pairs` at every read, each at its
    size in `sizes`, in DataLoader workers. `pad`: images of different sizes, padded per batch
    to a multiple of `pad` (pad_collate). `epoch` lives in shared memory, so persistent workers
    see the recipe set it before each epoch."""

    def __init__(self, pairs, classes, mode, sizes, *, seed, randoms, cache=None, pad=0):
        self.pairs, self.classes, self.mode, self.sizes = pairs, classes, mode, sizes
        self.seed, self.with_randoms, self.cache, self.pad = seed, randoms, cache, pad
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        # copy_paste: (the share of training samples that get another's objects, the background
        # class); set by the recipe once the data has decided its settings.
        self.paste = (0.0, 0)

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
        images, masks = self.read(indices)
        if not self.with_randoms:
            return images, masks
        rand, partners = self.seeded(indices)
        if partners:  # copy-paste: at the read, as it takes a second sample
            rows, sources = zip(*partners)
            at = to_device(index_tensor(rows), images.device)
            pasted = copy_paste(
                images.index_select(0, at),
                masks.index_select(0, at),
                *self.read(list(sources)),
                background=self.paste[1],
            )
            images, masks = images.index_copy(0, at, pasted[0]), masks.index_copy(0, at, pasted[1])
        return images, masks, rand

    def read(self, indices):
        """uint8 images [N, C, H, W] and int64 class masks [N, H, W] of these samples."""
        if self.cache is None:
            pairs = [
                decode_pair(self.pairs, i, self.classes, self.mode, self.sizes[i]) for i in indices
            ]
        elif self.pad:  # a list of images of their own sizes
            pairs = [(self.cache[0][i], self.cache[1][i]) for i in indices]
        else:  # one gather per tensor, where the cache is
            index = to_device(index_tensor(indices), self.cache[0].device)
            return self.cache[0].index_select(0, index), as_classes(
                self.cache[1].index_select(0, index)
            )
        pairs = [(image, as_classes(mask)) for image, mask in pairs]
        if self.pad:
            return pad_collate(pairs, self.pad)
        return tuple(map(torch.stack, zip(*pairs)))

    def randoms(self, indices):
        """[len(indices), RANDOMS] uniform numbers in [0, 1), each row from its sample's seed."""
        return self.seeded(indices)[0]

    def seeded(self, indices):
        """randoms(indices), and with copy-paste on, the (row, sample) pairs of the samples that
        get another's objects and that other sample's index: two more numbers from each sample's
        seed say whether and which (never itself), the same on any number of processes."""
        gen, base = torch.Generator(), (self.seed * 1_000_003 + self.epoch) * 1_000_003
        share, count = self.paste[0], len(self.pairs)
        rows, partners = [], []
        for row, i in enumerate(indices):
            rows.append(torch.rand(RANDOMS, generator=gen.manual_seed(base + i)))
            if share and count > 1:
                chosen, which = torch.rand(2, generator=gen).tolist()
                if chosen < share:
                    partners.append((row, (i + 1 + int(which * (count - 1))) % count))
        return torch.stack(rows), partners


@dataclass
class SegmentationData:
    train_loader: DataLoader
    val_loader: DataLoader
    classes: MaskClasses  # class i is mask value classes.values[i]; what counts for nothing
    num_classes: int  # the setting, or the number of mask values
    input_size: tuple | None  # (height, width) of every model input; None: each image its own
    in_channels: int  # the setting, or the images' (input_channels of their mode)
    class_pixels: list  # the training masks' pixels of each class
    notes: list  # lines for the start-up: what the data suggests, such as a void label
    background: int  # the background class: as asked, or the one of the most training pixels
    colours: list | None  # the dataset's colour of each class (class_colours), or None
    table: list  # lines of each class's share of the pixels, for the data check (class_table)
    twins: list  # (i, j): classes that a horizontal flip turns into each other (mirror_twins)
    mirrored: list  # (i, difference): classes whose shapes a flip changes (mirror_shapes)
    max_batch_pixels: int  # bucket_by_size: the padded pixels of a training batch; else 0
    batch: object  # for describe(): the batch size, or what a bucketed batch holds
    shapes: str  # the images' size, for the start-up line
    reading: str  # how the images are read: cached or decoded per read, for the start-up line
    cached: bool  # cache_images as resolved: decoded once at start-up
    eval_batch_size: int  # as resolved (eval_batch_images); bucket_by_size: as given, 0 by pixels
    evaluation: str  # what an evaluation batch holds, for the start-up line

    @property
    def values(self):
        return list(self.classes.values)

    @property
    def names(self):
        return self.classes.labels

    def __str__(self):
        classes = self.classes
        sigmoid = " (one sigmoid output)" if self.num_classes == 1 else ""
        ignored = [show_value(v, classes.colour) for v in classes.ignored]
        ignored += ["every other value"] if classes.unlisted_ignored else []
        ignored = f"; ignored: {', '.join(ignored)}" if ignored else ""
        colours = "colours" if classes.colour else "values"
        names = f" ({show_values(classes.names, False, most=12)})" if classes.names else ""
        return (
            f"{self.reading}; {self.evaluation}; {len(self.train_loader.dataset)} train / "
            f"{len(self.val_loader.dataset)} validation images of {self.shapes}; classes: mask "
            f"{colours} {show_values(classes.values, classes.colour, most=12)}{names}{sigmoid}"
            f"{ignored}"
        )


def eval_batch_images(eval_batch_size, *, batch_size, train_pixels, eval_pixels):
    """Images per evaluation batch: eval_batch_size, or for 0, as many as hold the pixels of a
    training batch (at least one). Evaluation then needs no more memory than training: at the
    same pixels it keeps less, as it saves no activations for a backward pass and holds no
    gradients or optimizer state (measured in docs/performance.md: Carvana's size took 16
    evaluation images at once where training took 4, and more memory than training)."""
    return eval_batch_size or max(1, batch_size * train_pixels // eval_pixels)


def decoded(pairs, classes, mode, sizes, *, fixed, threads, device, cache_decoded):
    """decode_all() of the pairs, once: when all share one size (`fixed`) through common.cache
    (cache_decoded), keyed by the pairs' identity() and by the code that reads and decodes them,
    so a later run on the same files and code reads a file instead; then onto `device`."""
    if not fixed:  # images of their own sizes: a list per split, decoded every run
        images, masks = decode_all(pairs, classes, mode, sizes, threads, stack=False)
        return [t.to(device) for t in images], [t.to(device) for t in masks]
    key = ["segmentation", pairs.identity(), classes.cache_key(), mode, list(sizes[0])]
    code = (type(pairs).__getitem__, decode_pair, MaskClasses)
    images, masks = cached_tensors(
        key,
        lambda: decode_all(pairs, classes, mode, sizes, threads, stack=True),
        code=code,
        enabled=cache_decoded,
    )
    return images.to(device), masks.to(device)


def load_segmentation(
    train_pairs,
    val_pairs,
    *,
    accelerator,
    classes,
    fixed,
    num_classes,
    in_channels,
    image_size,
    scale,
    bucket_by_size,
    max_batch_pixels,
    cache_images,
    cache_decoded,
    batch_size,
    eval_batch_size,
    crop_size,
    seed,
    num_workers,
    pad_multiple,
    min_size,
    background="",
    global_batch=0,
):
    """Check every mask on all processes, then build the training and validation loaders: plain
    ones for accelerator.prepare() to shard, or with bucket_by_size, bucketed ones that are
    sharded and on the device already (do not prepare them).
    global_batch (global_batch_size): training batches of batch_size images in the order of
    global batches of that many (common.sampler.GlobalBatchOrder), the same on any number of
    processes; with bucket_by_size, of similar sizes, and prepared here.
    classes: MaskClasses as asked (values None: those found); `fixed`: where given values come
    from, for messages (--mask_values, a weights file). image_size: (h, w) or None; scale: 0, or
    each image's own size times it (target_sizes). cache_images: True, False or None (auto: if
    it fits CACHE_BUDGET_GB): each process decodes all images once onto its device (a GPU's
    memory is its own) and gathers its batches there, with no workers; cache_decoded: keep
    those decoded tensors, and the scan, on disk for later runs. eval_batch_size: images per
    evaluation batch, or 0: as many as hold a training batch's pixels (eval_batch_images), where
    crop_size (0: none) is the side of the square that training crops. pad_multiple: padded sides
    are multiples of it; min_size: the model's smallest side. background: the background class's
    mask value or name (background_class). With `fixed` "" (values found, or a --class_names
    file's), the notes say which class looks like a void label (void_notes)."""
    require_one_batch_per_process(len(train_pairs), batch_size, accelerator, "the training data")
    scan = scan_pairs(accelerator, [train_pairs, val_pairs], remember=cache_decoded)
    classes, num_classes, notes = choose_classes(
        scan, classes, num_classes=num_classes, fixed=fixed
    )
    sizes, input_size = target_sizes(
        scan.sizes,
        image_size=image_size,
        scale=scale,
        bucket_by_size=bucket_by_size,
        min_size=min_size,
    )
    channels = channels_of_data(in_channels, scan.modes)
    mode = MODES[channels]
    pixels = sum(h * w for split in sizes for h, w in split)
    mask_bytes = classes.dtype.itemsize
    size_gb = (channels + mask_bytes) * pixels / 2**30  # uint8 channels and the class masks
    cached = size_gb <= CACHE_BUDGET_GB if cache_images is None else cache_images
    device = accelerator.device
    workers = 0 if cached else worker_count(num_workers, accelerator.num_processes)
    if cached:
        reading = f"images decoded once, {size_gb * 1024:.0f} MB in {device.type} memory"
    else:
        where = f"by {workers} DataLoader worker(s) per" if workers else "in the training"
        reading = f"images decoded at every read {where} process"

    def dataset(pairs, split_sizes, train):
        cache = None
        if cached:
            cache = decoded(
                pairs,
                classes,
                mode,
                split_sizes,
                fixed=input_size is not None,
                threads=cpus_per_process(accelerator.num_processes),
                device=device,
                cache_decoded=cache_decoded,
            )
        pad = pad_multiple if bucket_by_size else 0
        return SegmentationSet(
            pairs, classes, mode, split_sizes, seed=seed, randoms=train, cache=cache, pad=pad
        )

    train_set, val_set = dataset(train_pairs, sizes[0], True), dataset(val_pairs, sizes[1], False)
    pin = device.type == "cuda" and not cached  # non_blocking: the copy to the GPU does not wait
    class_pixels = [scan.values.get(v, NO_STATS)[TRAIN_PIXELS] for v in classes.values]
    background = background_class(classes, class_pixels, background)
    known = (classes, num_classes, input_size, channels, class_pixels, notes, background)
    known += (
        class_colours(scan, classes),
        class_table(scan, classes),
        mirror_twins(scan, classes),
        mirror_shapes(scan, classes, background),
    )
    if not bucket_by_size:  # each loader with its own generator: see seeded_loader
        height, width = input_size
        trained = min(crop_size, height) * min(crop_size, width) if crop_size else height * width
        eval_batch_size = eval_batch_images(
            eval_batch_size, batch_size=batch_size, train_pixels=trained, eval_pixels=height * width
        )
        loaders = [
            seeded_loader(
                dataset,
                batch_size=size,
                shuffle=shuffle,
                seed=seed,
                num_workers=workers,
                pin_memory=pin,
                global_batch=global_batch if shuffle else 0,
            )
            for dataset, size, shuffle in (
                (train_set, batch_size, True),
                (val_set, eval_batch_size, False),
            )
        ]
        shape, evaluation = f"{width}x{height}", f"evaluation batches of {eval_batch_size} images"
        return SegmentationData(
            *loaders, *known, 0, batch_size, shape, reading, cached, eval_batch_size, evaluation
        )
    # A budget of padded pixels per batch; validation gets eval_batch_size / batch_size times more,
    # or with eval_batch_size 0 the same budget (eval_batch_images).
    train_sizes, val_sizes = (
        [(padded(h, pad_multiple), padded(w, pad_multiple)) for h, w in part] for part in sizes
    )
    budget = max_batch_pixels or batch_size * max(h * w for h, w in train_sizes)
    if global_batch:  # batch_size images of similar sizes, dealt out as prepare() deals batches
        train = seeded_loader(
            train_set,
            batch_size,
            shuffle=True,
            seed=seed,
            num_workers=workers,
            pin_memory=pin,
            global_batch=global_batch,
            sizes=train_sizes,
        )
        train = accelerator.prepare(train)
    else:
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
    val_budget = max(budget * eval_batch_size // batch_size, 1) if eval_batch_size else budget
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
    shape = "their own sizes" + (f" times {scale:g}" if scale else "")
    evaluation = f"evaluation batches of at most {val_budget} padded pixels"
    if global_batch:  # a count of images per batch, not a pixel budget
        budget, batch = 0, batch_size
    return SegmentationData(
        train, val, *known, budget, batch, shape, reading, cached, eval_batch_size, evaluation
    )


# ---- The weights file's record: what predict needs besides the weights ----

RECORD = "segmentation"  # the entry of a weights file's metadata that holds it (record_metadata)
# The model's settings; the classes' mask values (and those ignored in training); how images were
# sized (input_size, or each its own size times scale); the flips of training (predict_flip).
RECORDED = ("model", "mask_values", "ignored", "ignore_unlisted", "colour_masks", "input_size")
RECORDED += ("scale", "flips")
# Recorded since, with what a file written before means: no names, class 0 the background, and
# the recipe's colours.
OPTIONAL = {"class_names": None, "background": 0, "colours": None}


def weights_record(data, *, model, scale, flips):
    """The record of a training run on `data` (SegmentationData), for its weights files: `model`,
    the settings that rebuild the model; the classes' mask values, the values ignored and how
    (predict never writes them), and whether they are colours; the input size (None: each image
    its own, times `scale`); the flips of training; the class names, the background class and
    the dataset's colours, for predict's overlays."""
    return {
        "model": model,
        "mask_values": data.values,
        "ignored": list(data.classes.ignored),
        "ignore_unlisted": data.classes.unlisted_ignored,
        "colour_masks": data.classes.colour,
        "input_size": data.input_size,
        "scale": scale,
        "flips": flips,
        "class_names": list(data.classes.names or []) or None,
        "background": data.background,
        "colours": data.colours,
    }


def read_weights_record(path, model_settings):
    """The record (weights_record) of a weights file, a .safetensors or an .onnx exported from
    one, or None for one that holds none, such as a torch.save'd state_dict. One that an older
    version of the recipe wrote, recording less (RECORDED, or the model's `model_settings`),
    stops with a line that says to train again."""
    record = read_record(path, RECORD) if path else None
    if record is None:
        return None
    missing = sorted(set(RECORDED) - set(record))
    missing = missing or sorted(set(model_settings) - set(record["model"]))
    if missing:
        raise UserError(
            f"{path} records no {', '.join(missing)}: an older version of this recipe wrote it; "
            f"train the model again to write it anew"
        )
    return {**OPTIONAL, **record}
