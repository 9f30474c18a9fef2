"""Image and mask files paired by name, for segmentation data in folders, with one-line errors
that name what a folder holds and the flags that fit it.

    train, val = folder_splits("data/pet/images", "data/pet/annotations/trimaps",
                               val_list="data/pet/annotations/test.txt")  # or val_images
    pairs = folder_pairs("data/isic/input", "data/isic/truth", mask_name="{stem}_segmentation.png")
    train, val = table_splits("data/x", ["train", "validation"], ["image", "mask"], hint="...")
    hint = layout_hint("data/camvid")   # what a folder holds, and the flags that would read it

A pair is (image path, mask path, name). A mask's file name comes from its image's stem by a
pattern (mask_name): "{stem}.png" (Pet's trimaps), "{stem}_segmentation.png" (ISIC),
"{stem}_L.png" (CamVid), "{stem}_mask.gif" (Carvana); "*" stands for any image type. The default,
"", is milesial/Pytorch-UNet's: "{stem}.*" or "{stem}_mask.*".
"""

import csv
import fnmatch
import glob
import os
import re
from pathlib import Path

import torch

from common.config import shell_flag
from common.data import IMAGE_SUFFIXES, DataError, TableRows, load_splits
from common.segmentation.data import void_name

DEFAULT_MASK_NAMES = ("{stem}.*", "{stem}_mask.*")
LIST_SUFFIXES = (".txt", ".lst")  # files that list the names of a split, one per line


def image_paths(where, what="--images"):
    """The image files of a folder (not its subfolders) or of a glob, sorted; a DataError names
    a folder that does not exist or a glob that matches no image."""
    if Path(where).is_dir():
        paths = sorted(
            (p for p in Path(where).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=str
        )
        if not paths:
            raise DataError(f"{what} {where} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
        return paths
    paths = sorted((Path(p) for p in glob.glob(where, recursive=True) if is_image(p)), key=str)
    if not paths:
        exists = glob.has_magic(where) or Path(where).exists()
        why = "matches no image files" if exists else "does not exist"
        raise DataError(
            f"{what} {where} {why}: give a folder of images, or a glob such as DIR/*.jpg"
        )
    return paths


def mask_finder(masks, mask_name, stems, what="--masks"):
    """A function stem -> [mask paths] for the masks of `masks` (a folder, or a glob of the mask
    files) named by the pattern mask_name ("" for DEFAULT_MASK_NAMES), for the image `stems`.
    The masks are indexed by stem once, so pairing is linear in the number of files: a pattern
    with "*" is matched once per mask name and stem it could hold, never once per pair."""
    patterns = [mask_name] if mask_name else DEFAULT_MASK_NAMES
    if Path(masks).is_dir():
        files = {p.name: p for p in Path(masks).iterdir()}
    else:
        files = {Path(p).name: Path(p) for p in glob.glob(masks, recursive=True)}
        if not files:
            raise DataError(f"{what} {masks} does not exist: give the folder of the masks")
    stems = set(stems)
    index = {}  # stem: its masks, in the order of the patterns, then of the names
    for pattern in patterns:
        before, after = pattern.split("{stem}", 1)
        if "*" not in pattern:  # one name per stem: look it up
            for stem in stems:
                if (name := f"{before}{stem}{after}") in files:
                    index.setdefault(stem, []).append(files[name])
            continue
        head, tail = (re.compile(fnmatch.translate(part)) for part in (before, after))
        for name in sorted(n for n in files if is_image(n)):
            for stem in stems_in(name, head, tail, stems):
                index.setdefault(stem, []).append(files[name])

    def find(stem):
        return index.get(stem, [])

    find.files = files
    return find


def stems_in(name, head, tail, stems):
    """The stems among `stems` that make the file `name` read as head + stem + tail, where head
    and tail are compiled glob patterns and a stem is taken as it is (brackets and all). Each
    split of the name is tried: the work grows with the name's length, not with the stems."""
    if head.pattern == fnmatch.translate(""):  # the pattern starts with the stem
        starts = [0]
    else:
        starts = [i for i in range(len(name) + 1) if head.fullmatch(name[:i])]
    return [
        name[start:end]
        for start in starts
        for end in range(start + 1, len(name) + 1)
        if name[start:end] in stems and tail.fullmatch(name[end:])
    ]


def is_image(name):
    return Path(name).suffix.lower() in IMAGE_SUFFIXES


def folder_pairs(images, masks, *, mask_name="", names=None, what=("--images", "--masks")):
    """[(image path, mask path, name)] of the images in `images` (a folder or a glob), each with
    its mask in `masks` named by `mask_name`; `names`: only the images of these stems, in that
    order (a split's list), each of which must be there. One line for an image without a mask,
    which says how the masks there are named."""
    paths = image_paths(images, what[0])
    if names is not None:
        by_stem = {p.stem: p for p in paths}
        missing = [n for n in names if n not in by_stem]
        if missing:
            raise DataError(
                f"{len(missing)} name(s) of the list, such as {missing[0]!r}, have no image in "
                f"{images}: check the list, or the folder of --images"
            )
        paths = [by_stem[n] for n in names]
    find = mask_finder(masks, mask_name, [p.stem for p in paths], what[1])
    pairs = []
    for image in paths:
        found = find(image.stem)
        if len(found) != 1:
            raise DataError(missing_mask(image, found, masks, mask_name, find.files))
        pairs.append((image, found[0], str(found[0])))
    return pairs


def missing_mask(image, found, masks, mask_name, files):
    """The line for an image with no mask (or two): what was looked for, and how the masks in
    that folder are named, as the --mask_name that would find them."""
    patterns = [mask_name] if mask_name else DEFAULT_MASK_NAMES
    looked = " or ".join(str(Path(masks) / p.format(stem=image.stem)) for p in patterns)
    if found:
        return (
            f"{image} has {len(found)} masks ({', '.join(p.name for p in found)}): set "
            f"--mask_name to the one pattern, such as {{stem}}{found[0].name[len(image.stem) :]}"
        )
    named = [n for n in sorted(files) if is_image(n)]
    guess = mask_name_of(image.stem, named)
    hint = (
        f"; the masks there are named like {guess.format(stem=image.stem)}: "
        f"{shell_flag('mask_name', guess)}"
        if guess and guess != mask_name
        else f"; the masks there are named like {named[0]}: set --mask_name"
        if named
        else f"; {masks} holds no image files: check --masks"
    )
    return f"{image} has no mask: looked for {looked}{hint}"


def mask_name_of(stem, names):
    """The pattern that names a mask after an image of this stem, from a folder's file `names`
    (such as "{stem}_segmentation.png"), or None if no name there starts with the stem."""
    for name in names:
        if name.startswith(stem) and name != stem:
            return "{stem}" + name[len(stem) :]
    return None


def read_names(path):
    """The names a split's list holds: the first word of each line, as Pascal VOC's
    ImageSets/Segmentation/train.txt and the Oxford-IIIT Pet's annotations/test.txt give them;
    lines starting with # are comments. A name may carry its image's suffix."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"list {path} does not exist: give a file with an image name per line")
    names = [
        Path(line.split()[0]).stem if is_image(line.split()[0]) else line.split()[0]
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not names:
        raise DataError(f"list {path} holds no names: give a file with an image name per line")
    return names


def split_pairs(pairs, *, val_names=None, train_names=None, val_fraction=0.1):
    """(train, validation) of `pairs`: those named in val_names validate, and those in
    train_names (default: the rest) train; without val_names, a fixed share val_fraction
    validates, drawn with its own generator, as milesial/Pytorch-UNet does: the same images for
    any seed and any number of processes."""
    if val_names is not None:
        stems = {Path(p[0]).stem for p in pairs}
        missing = [n for n in [*val_names, *(train_names or [])] if n not in stems]
        if missing:
            raise DataError(
                f"{len(missing)} name(s) of the lists, such as {missing[0]!r}, have no image "
                f"among the {len(pairs)} images: check the lists, or the folder of --images"
            )
        held = set(val_names)
        val = [p for p in pairs if Path(p[0]).stem in held]
        trained = set(train_names) if train_names is not None else None
        train = [
            p
            for p in pairs
            if Path(p[0]).stem not in held and (trained is None or Path(p[0]).stem in trained)
        ]
        if not val or not train:
            which = "validation" if not val else "training"
            raise DataError(f"the lists leave no {which} images among {len(pairs)}: check them")
        return train, val
    n_val = int(len(pairs) * val_fraction)
    if not 0 < n_val < len(pairs):
        raise DataError(
            f"val_fraction {val_fraction} of {len(pairs)} images leaves none to validate or train"
        )
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()
    return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]


def folder_splits(
    images,
    masks,
    *,
    mask_name="",
    val_images="",
    val_masks="",
    train_list="",
    val_list="",
    val_fraction=0.1,
):
    """(train, validation) pairs of folders (or globs) of images and masks: the validation
    images are val_images (their masks in val_masks, else in masks), or those of `images` named
    in the file val_list, or a fixed share val_fraction of them (split_pairs); train_list: a file
    that names the training images, where `images` holds more (Pascal VOC's JPEGImages/)."""
    train_names, val_names = (read_names(f) if f else None for f in (train_list, val_list))
    if val_images:
        train = folder_pairs(images, masks, mask_name=mask_name, names=train_names)
        val = folder_pairs(
            val_images,
            val_masks or masks,
            mask_name=mask_name,
            names=val_names,
            what=("--val_images", "--val_masks"),
        )
        return train, val
    names = None if train_names is None else train_names + (val_names or [])
    pairs = folder_pairs(images, masks, mask_name=mask_name, names=names)
    return split_pairs(
        pairs, val_names=val_names, train_names=train_names, val_fraction=val_fraction
    )


def table_splits(dataset, splits, columns, *, hint):
    """The rows of two splits (train, validation) of what datasets.load_dataset reads (a hub
    name, or parquet files SPLIT*.parquet), each a TableRows of (image, mask, name) by the two
    `columns`. hint: the other layouts the recipe reads, said with a dataset that is not here."""
    hint = (
        f"{hint}, or parquet files {splits[0]}*.parquet and {splits[1]}*.parquet with columns "
        f"{' and '.join(columns)}"
    )
    loaded = load_splits(dataset, splits, columns, hint)
    return [TableRows(loaded[s], columns, f"{dataset} {s}", "image or mask") for s in splits]


# ---- What a folder holds, for the first error a new layout meets ----

MASK_WORDS = ("mask", "label", "annot", "gt", "truth", "trimap", "segment", "class")
VAL_WORDS = ("val", "test")


def image_folders(root, depth=3):
    """{folder relative to root: [image file names]} of the folders under root (up to `depth`
    levels down) that hold image files, in sorted order."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        relative = Path(folder).relative_to(root)
        deeper = len(relative.parts) < depth
        subfolders[:] = sorted(s for s in subfolders if not s.startswith(".")) if deeper else []
        images = sorted(f for f in files if is_image(f) and not f.startswith("."))
        if images:
            found[relative] = images
    return found


def _pairing(images, masks):
    """The mask_name that names most of `masks` (file names) after one of `images`, or None."""
    stems, patterns = {Path(n).stem for n in images}, {}
    sample = masks[:50]
    for mask in sample:
        stem = next((mask[:i] for i in range(len(mask), 0, -1) if mask[:i] in stems), None)
        if stem is not None and mask != stem:
            pattern = "{stem}" + mask[len(stem) :]
            patterns[pattern] = patterns.get(pattern, 0) + 1
    best = max(patterns, key=patterns.get, default=None)
    return best if best and patterns[best] >= 0.9 * len(sample) else None


def _is(folder, words):
    return any(w in str(folder).lower() for w in words)


def _split_list(root, masks, words):
    """A file under root that lists names (LIST_SUFFIXES) whose stem has one of `words`, and
    whose first names have masks (`masks`: mask stems): Pet's annotations/test.txt, VOC's
    ImageSets/Segmentation/val.txt; or None."""
    lists = sorted(p for s in LIST_SUFFIXES for p in root.rglob(f"*{s}") if _is(p.stem, words))
    for path in sorted(lists, key=lambda p: (p.stem.lower() not in words, str(p))):
        names = path.read_text(errors="replace").split("\n")[:20]
        names = [line.split()[0] for line in names if line.strip() and not line.startswith("#")]
        if names and sum(n in masks for n in names) >= 0.9 * len(names):
            return path
    return None


def layout_hint(root):
    """What folder `root` holds (its image folders, their file counts and types) and the flags
    that would read it: --images, --masks, --mask_name, and --val_images and --val_masks,
    --train_list and --val_list, or --class_names, with --ignore_index for its void class (CamVid's
    Void), where the folder has them. Part of a line: "it holds ...: read it with ...", each value
    quoted where a shell needs it (shell_flag)."""
    root = Path(root)
    folders = image_folders(root)
    if not folders:
        return "it holds no image files"
    shown = ", ".join(
        f"{root / f}/ ({len(n)} {'/'.join(sorted({Path(x).suffix for x in n}))})"
        for f, n in list(folders.items())[:5]
    )
    pairs = [  # (images folder, masks folder, mask_name)
        (a, b, pattern)
        for a, a_names in folders.items()
        for b, b_names in folders.items()
        if a != b and not _is(a, MASK_WORDS)
        if (pattern := _pairing(a_names, b_names))
        and (_is(b, MASK_WORDS) or Path(pattern.format(stem="x")).stem != "x")
    ]
    if not pairs:
        return (
            f"it holds {shown}: point --images at the images and --masks at the masks, and name "
            f"a mask after its image with --mask_name, such as {{stem}}_mask.png"
        )
    train = [p for p in pairs if not _is(p[0], VAL_WORDS)]
    images, masks, pattern = (train or pairs)[0]
    flags = f"{shell_flag('images', root / images)} {shell_flag('masks', root / masks)}"
    default = Path(pattern).suffix.lower() in IMAGE_SUFFIXES and Path(pattern).stem in (
        "{stem}",
        "{stem}_mask",
    )
    flags += "" if default else f" {shell_flag('mask_name', pattern)}"
    val = [p for p in pairs if _is(p[0].name, VAL_WORDS) and p[0] != images]
    val.sort(key=lambda p: "val" not in p[0].name.lower())  # val/ before test/
    mask_stems = {Path(n).stem for n in folders[masks]}
    held = None if val else _split_list(root, mask_stems, ("val", "validation", "test"))
    if val:
        flags += f" {shell_flag('val_images', root / val[0][0])}"
        flags += f" {shell_flag('val_masks', root / val[0][1])}"
    elif held:
        trained = _split_list(held.parent, mask_stems, ("train", "trainval"))
        same = trained and trained.parent == held.parent
        flags += f" {shell_flag('train_list', trained)}" if same else ""
        flags += f" {shell_flag('val_list', held)}"
    names = sorted(root.glob("*.csv"))
    if names:  # name,r,g,b rows (CamVid's class_dict.csv): its void class counts for nothing
        flags += f" {shell_flag('class_names', names[0])}"
        with open(names[0], newline="", errors="replace") as f:
            void = void_name(row[0] for row in csv.reader(f) if row)
        flags += f" {shell_flag('ignore_index', void)}" if void else ""
    return f"it holds {shown}: read it with {flags}"
