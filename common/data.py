"""Loading a dataset by hub name or local folder, with one-line errors, and small data helpers.

    splits = load_splits("ylecun/mnist", ["train", "test"], columns=["image", "label"],
                         hint="use --dataset data/mnist_sample")   # said if it cannot be loaded
    splits = load_splits("data/mnist_sample", ["train", "test"], columns=["image", "label"])
    images = decode_images(splits["train"], "image", "train split")  # PIL images, or a DataError
    labels = class_labels(splits["train"], "label", num_classes=10, where="train split")  # int64
    require_one_batch_per_process(len(train_set), batch_size, accelerator, "the train split")
    workers = worker_count(-1, accelerator.num_processes)  # DataLoader workers: 1 a core, <= 8
    loader = seeded_loader(train_set, 64, True, seed, workers)  # for prepare() to shard
    loader = seeded_loader(train_set, 16, True, seed, global_batch=64)  # the same on any count
    TensorBatches(images, labels)       # a TensorDataset read a whole batch at a time
    x = random_shift(x, 2)              # augmentation: each image moved by up to 2 pixels
    files = image_files("digits/*.png")  # --predict's files, sorted, each header read
    image = read_image(files[0])        # decoded, or a DataError naming the file

A local folder is read by `datasets.load_dataset` itself: parquet files named
train*/test*, or the imagefolder layout train/<label>/*.png. A hub name is
downloaded once into the Hugging Face cache. Without internet the cache is used
if it holds the dataset, and otherwise the run stops at once, not after the hub
client's retries, with a message saying how to point `--dataset` at local data. A name that
looks like a path (./x, /x, ~/x, x.parquet, or data/x where data/ exists) is never sent to
the hub: a mistyped path says that it does not exist. A data file that does not read
(truncated, not parquet) or an image that does not decode is named in the error.
"""

import glob
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, TensorDataset

from common.config import UserError
from common.sampler import GlobalBatchOrder
from common.signals import ignore_stop_signals


class DataError(UserError):
    """The data does not match what the recipe needs. One line: the problem and the fix."""


DATA_SUFFIXES = (".parquet", ".csv", ".tsv", ".json", ".jsonl", ".arrow")
# What PIL raises for a file it cannot read: OSError (not an image, truncated, missing), and
# SyntaxError, ValueError or DecompressionBombError from some broken or huge files.
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")


def looks_like_path(name):
    """True for a local path, False for a hub name (owner/name, whose owner is no local folder)."""
    if name.startswith((".", "/", "~")) or name.endswith(DATA_SUFFIXES):
        return True
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()  # data/mnist_sampel, where data/ exists


def unreadable_image(what, e, kind="image"):
    """The DataError for an image (file or row `what`) that PIL cannot open or decode (error e)."""
    unknown = isinstance(e, UnidentifiedImageError)
    reason = "not an image file PIL can read" if unknown else _first_line(e)
    return DataError(f"cannot read {kind} {what} ({reason}): fix or remove the file")


def _hub_reachable(timeout_s=3.0):
    """A cheap check for internet access: can we open a TCP connection to the hub?"""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _go_offline():
    """Only the local cache from now on: a dataset missing from it fails at once, not after the
    hub client's retries. huggingface_hub and datasets read HF_HUB_OFFLINE when first imported;
    where they were imported already (a notebook, a test), their flags are set too."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True


def load_splits(name, splits, columns, hint=None):
    """Return {split: datasets.Dataset} for `splits`, each with the given `columns`.

    hint: the local data that works here, for a hub name that cannot be loaded and a path that
    does not exist, e.g. "use --dataset data/mnist_sample"; by default, parquet files of the
    splits and columns."""
    local = Path(name).expanduser()
    if local.exists():
        source = str(local)
    elif looks_like_path(name):
        raise DataError(
            f"dataset path {name} does not exist: check --dataset" + (f"; {hint}" if hint else "")
        )
    else:
        source = name
        if not _hub_reachable():
            _go_offline()

    import datasets
    import huggingface_hub
    import pyarrow

    huggingface_hub.utils.logging.set_verbosity_error()  # "Repo card metadata block was not found"
    datasets.disable_progress_bars()
    # Critical only while loading: datasets logs a bad file's error before it raises it, and the
    # DataError below says it in one line, with the file's name.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        loaded = datasets.load_dataset(source)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
        if local.exists():
            raise DataError(f"could not read dataset folder {name}: {e}") from None
        raise DataError(
            f"could not load {name!r}: no folder of that name here, and not from the Hugging Face "
            f"Hub ({type(e).__name__}; no internet?): point --dataset at a local folder"
            + (
                f": {hint}"
                if hint
                else f" that datasets.load_dataset reads, such as parquet "
                f"files {' and '.join(s + '*.parquet' for s in splits)} with columns "
                f"{' and '.join(columns)}"
            )
        ) from None
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as e:
        # A data file that does not read. datasets raises pyarrow's error if it is the first file
        # (whose schema it reads), else DatasetGenerationError from it; neither names the file.
        bad = _unreadable_parquet(local) if local.exists() else None
        if bad:
            path, reason = bad
            raise DataError(
                f"cannot read {path} ({reason}): it is truncated or not a parquet "
                f"file; write it again, or remove it from {name}"
            ) from None
        raise DataError(f"could not read dataset {name}: {_first_line(e.__cause__ or e)}") from None
    except (FileNotFoundError, ValueError) as e:  # no data files, unknown format, empty folder
        first = _first_line(e)
        if "corresponds to no data" in first:  # datasets' words for a split with no rows
            raise DataError(
                f"dataset {name} has an empty split ({first}): add samples to it"
            ) from None
        raise DataError(f"could not read dataset {name}: {first}") from None
    finally:
        datasets.logging.set_verbosity_error()

    out = {}
    for split in splits:
        if split not in loaded:
            raise DataError(
                f"dataset {name} has no {split!r} split (it has {', '.join(loaded)}): "
                f"name the files {split}*.parquet or the folder {split}/"
            )
        ds = loaded[split]
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise DataError(
                f"dataset {name} split {split!r} has no column {missing[0]!r} (it has "
                f"{', '.join(ds.column_names)}): set the column name in the config"
            )
        if len(ds) == 0:
            raise DataError(f"dataset {name} split {split!r} is empty")
        out[split] = ds
    return out


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _unreadable_parquet(local):
    """(path, reason) of the first parquet file in `local` (a file or folder) that pyarrow
    cannot read, or None. Footers first, which is quick; then, only if they all read, the
    row groups one at a time, for a file damaged inside."""
    import pyarrow
    import pyarrow.parquet as pq

    files = [local] if local.is_file() else sorted(local.rglob("*.parquet"))
    for whole in (False, True):
        for path in files:
            try:
                file = pq.ParquetFile(path)
                for i in range(file.num_row_groups if whole else 0):
                    file.read_row_group(i)
            except (pyarrow.ArrowException, OSError) as e:
                return path, _first_line(e).split(". ")[0]  # not "Either the file is corrupted..."
    return None


def decode_images(split, column, where):
    """The images of a datasets Image column as a list of PIL images, each decoded once, or a
    DataError naming the first that does not decode: its file, else its row.

    datasets would decode them too, but its error (from PIL, deep in a traceback) names no row
    of a parquet file. The column is read undecoded and decoded here the way datasets does it.
    """
    import datasets

    feature = split.features[column]
    if not isinstance(feature, datasets.Image):
        raise DataError(
            f"{where}'s column {column!r} holds {feature}, not images: check the image column"
        )
    raw = split.select_columns([column]).cast_column(column, datasets.Image(decode=False))[column]
    decode = datasets.Image(mode=feature.mode).decode_example
    images = []
    for i, value in enumerate(raw):
        if value is None:
            raise DataError(f"{where}: row {i} holds no image: fix or remove the row")
        try:
            images.append(decode(value))
        except IMAGE_ERRORS as e:
            path, data = value.get("path"), value.get("bytes")
            what = path if data is None and path else f"row {i}" + (f" ({path})" if path else "")
            raise DataError(f"{where}: {unreadable_image(what, e)}") from None
    return images


def require_one_batch_per_process(samples, batch_size, accelerator, what):
    """DataError unless `samples` fill one batch of `batch_size` on every process: with fewer, a
    prepared loader would repeat samples to give each process a batch."""
    if samples < batch_size * accelerator.num_processes:
        raise DataError(
            f"{what} has {samples} samples, fewer than one batch for each process "
            f"({batch_size} x {accelerator.num_processes} processes): lower batch_size"
        )


def cpus_per_process(processes):
    """The CPU cores this process may use, shared out between the processes of this machine
    (LOCAL_WORLD_SIZE, set by torchrun and accelerate launch; else all `processes`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", processes)))


def worker_count(num_workers, processes):
    """num_workers; -1: a worker per CPU core of this process's share, less one for the process
    itself, at most 8: more did not load faster (docs/performance.md)."""
    return num_workers if num_workers >= 0 else min(8, max(1, cpus_per_process(processes) - 1))


def seeded_loader(
    dataset, batch_size, shuffle, seed, num_workers=0, pin_memory=False, global_batch=0, sizes=None
):
    """A DataLoader as the recipes build theirs, for prepare() to shard. Its own generator:
    starting an epoch draws nothing from the global RNG (dropout), so a resumed run goes on with
    the same random numbers as an uninterrupted one. Persistent workers: starting them every
    epoch costs seconds, and until worker_init_fn runs torch's handler lets SIGTERM kill one, so
    a worker started once is exposed once; they leave Ctrl-C and SIGTERM to the training process
    (ignore_stop_signals). collate_fn=tuple: the dataset returns whole batches.
    global_batch (training, the global_batch_size setting): the samples in the order of
    common.sampler.GlobalBatchOrder (with `sizes`: similar sizes per global batch), so that
    prepare() deals every optimizer step the same global batch on any number of processes; a
    DataError if the data holds less than one."""
    order = None
    if global_batch:
        if len(dataset) < global_batch:
            raise DataError(
                f"the training data has {len(dataset)} samples, fewer than one global batch "
                f"(global_batch_size {global_batch}): lower global_batch_size"
            )
        order, shuffle = GlobalBatchOrder(len(dataset), global_batch, seed, sizes), False
    return DataLoader(
        dataset,
        batch_size,
        shuffle=shuffle,
        sampler=order,
        collate_fn=tuple,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        worker_init_fn=ignore_stop_signals,
        generator=torch.Generator().manual_seed(seed),
    )


def to_device(tensor, device):
    """A CPU tensor on `device`; to a GPU from pinned memory, so that the copy does not wait for
    the GPU's queued work."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def random_shift(images, pixels):
    """Each image of a batch [N, C, H, W] moved by its own random offset of up to `pixels` in
    each direction, filled with 0 (MNIST's background), on the batch's device. The offsets come
    from torch's global RNG of that device, which Accelerate's checkpoints save, so a resumed
    run draws the same ones. pixels=0: the batch itself, and no random numbers drawn."""
    if not pixels:
        return images
    n, _, h, w = images.shape
    dy, dx = torch.randint(0, 2 * pixels + 1, (2, n, 1, 1), device=images.device)
    rows = torch.arange(h, device=images.device).view(1, h, 1) + dy  # [N, H, 1] in the padded image
    cols = torch.arange(w, device=images.device).view(1, 1, w) + dx  # [N, 1, W]
    padded = torch.nn.functional.pad(images, [pixels] * 4)
    batch = torch.arange(n, device=images.device).view(n, 1, 1)
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # [N, H, W, C] -> [N, C, H, W]


def open_image(path, kind="image"):
    """Image.open(path): the header is read, the pixels when first used. A DataError naming the
    file if PIL cannot open it."""
    try:
        return Image.open(path)
    except IMAGE_ERRORS as e:
        raise unreadable_image(path, e, kind) from None


def read_image(path):
    """open_image(path) with its pixels decoded: a DataError names a file that does not decode
    (a truncated one, whose header reads)."""
    image = open_image(path)
    try:
        image.load()
    except IMAGE_ERRORS as e:
        raise unreadable_image(path, e) from None
    return image


def image_files(pattern, suffixes=IMAGE_SUFFIXES):
    """The image files (names ending in one of `suffixes`) that a --predict glob matches, sorted,
    each header read once: a DataError for no match or a file PIL cannot open. Every process
    that calls it on the same files stops alike."""
    files = sorted(p for p in glob.glob(pattern) if Path(p).suffix.lower() in suffixes)
    if not files:
        raise DataError(
            f"--predict {pattern!r} matches no image files ({', '.join(sorted(suffixes))}): "
            f"check the path or pattern"
        )
    for path in files:
        open_image(path).close()
    return files


class TableRows:
    """The rows of a datasets.Dataset as (*columns, name), decoded when read; a row that does
    not decode stops with a DataError naming it and `what` it holds."""

    def __init__(self, ds, columns, where, what="image"):
        self.ds, self.columns, self.where, self.what = ds, columns, where, what

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        try:
            row = self.ds[i]  # decodes the images
        except IMAGE_ERRORS as e:
            raise unreadable_image(f"{self.where} row {i}", e, self.what) from None
        return (*(row[c] for c in self.columns), f"{self.where} row {i}")


class TensorBatches(TensorDataset):
    """A TensorDataset that the DataLoader reads a batch at a time (`__getitems__`): one indexing
    operation per batch, no collate. Its tensors may live on the GPU: the sampler still picks
    the indices (sharding, shuffling, resume are unchanged), and only they are copied per step."""

    def __getitems__(self, indices):
        indices = index_tensor(indices)
        if self.tensors[0].is_cuda:  # a plain copy to the GPU would wait for all its queued work
            indices = indices.pin_memory().to(self.tensors[0].device, non_blocking=True)
        return tuple(t.index_select(0, indices) for t in self.tensors)  # 3x t[indices] on a CPU


def index_tensor(indices):
    """A sampler's batch of indices (a list of ints) as an int64 tensor, by way of numpy:
    torch.as_tensor of a Python list takes over 10 times as long, per batch (docs/performance.md,
    "Per-step host work")."""
    return torch.from_numpy(np.asarray(indices, dtype=np.int64))


def class_names(split, column, where):
    """The names of the classes of a datasets split's label column: its ClassLabel's names (an
    imagefolder's folder names, ylecun/mnist's "0".."9"), else the labels 0..the largest one,
    as text. A DataError names a column that holds no class indices."""
    import datasets

    feature = split.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    labels = split.select_columns([column]).with_format("numpy")[:][column]
    if labels.dtype.kind not in "iu" or len(labels) == 0:
        raise DataError(
            f"{where}'s column {column!r} holds {feature}, not class indices: map the labels to "
            f"integers 0, 1, ..."
        )
    if labels.min() < 0:
        raise DataError(f"{where} has label {labels.min()}; labels must be 0 or more")
    return [str(i) for i in range(int(labels.max()) + 1)]


def class_labels(split, column, *, num_classes, where):
    """A datasets split's label column as int64 class indices, read as one column, or a
    DataError naming the column's type or the label out of range."""
    labels = split.select_columns([column]).with_format("numpy")[:][column]
    if labels.dtype.kind not in "iu":
        raise DataError(
            f"{where}'s column {column!r} holds {split.features[column]}, not class "
            f"indices: map the labels to integers 0..{num_classes - 1}"
        )
    labels = torch.from_numpy(labels).long()
    if labels.min() < 0 or labels.max() >= num_classes:
        bad = int(labels.max() if labels.max() >= num_classes else labels.min())
        raise DataError(f"{where} has label {bad}; labels must be 0..{num_classes - 1}")
    return labels
