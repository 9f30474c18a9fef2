"""Loading a dataset by hub name or local folder, with one-line errors, and small data helpers.

    splits = load_splits("ylecun/mnist", ["train", "test"], columns=["image", "label"])
    splits = load_splits("data/mnist_sample", ["train", "test"], columns=["image", "label"])
    labels = class_labels(splits["train"], "label", 10, "train split")   # int64, checked
    require_one_batch_per_process(len(train_set), batch_size, accelerator, "the train split")
    TensorBatches(images, labels)       # a TensorDataset read a whole batch at a time

A local folder is read by `datasets.load_dataset` itself: parquet files named
train*/test*, or the imagefolder layout train/<label>/*.png. A hub name is
downloaded once into the Hugging Face cache. Without internet the cache is used
if it holds the dataset, and otherwise the run stops at once with a message
saying how to point `--dataset` at local data (instead of ~25 s of retries).
"""

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch.utils.data import TensorDataset

from common.config import UserError


class DataError(UserError):
    """The data does not match what the recipe needs. One line: the problem and the fix."""


def _looks_like_path(name):
    return name.startswith((".", "/", "~")) or name.endswith((".parquet", ".csv", ".json"))


def _hub_reachable(timeout_s=3.0):
    """A cheap check for internet access: can we open a TCP connection to the hub?"""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def load_splits(name, splits, columns):
    """Return {split: datasets.Dataset} for `splits`, each with the given `columns`."""
    local = Path(name).expanduser()
    if local.exists():
        source = str(local)
    elif _looks_like_path(name):
        raise DataError(f"dataset path {name} does not exist: check --dataset")
    else:
        source = name
        if not _hub_reachable():
            # Read when huggingface_hub is first imported (below): then only the local cache is
            # used, and a dataset missing from it fails at once instead of after retries.
            os.environ["HF_HUB_OFFLINE"] = "1"

    import datasets
    import huggingface_hub

    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()  # "Repo card metadata block was not found"
    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_dataset(source)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
        if local.exists():
            raise DataError(f"could not read dataset folder {name}: {e}") from None
        raise DataError(
            f"could not load {name!r}: no folder of that name here, and not from the Hugging Face Hub "
            f"({type(e).__name__}; no internet?): "
            f"point --dataset at a local folder that datasets.load_dataset reads, such as parquet files "
            f"{' and '.join(s + '*.parquet' for s in splits)} with columns {' and '.join(columns)}"
        ) from None
    except (FileNotFoundError, ValueError) as e:  # no data files, unknown format, empty folder
        first = str(e).splitlines()[0]
        if "corresponds to no data" in first:  # datasets' words for a split with no rows
            raise DataError(f"dataset {name} has an empty split ({first}): add samples to it") from None
        raise DataError(f"could not read dataset {name}: {first}") from None

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


def require_one_batch_per_process(samples, batch_size, accelerator, what):
    """DataError unless `samples` fill one batch of `batch_size` on every process: with fewer, a
    prepared loader would repeat samples to give each process a batch."""
    if samples < batch_size * accelerator.num_processes:
        raise DataError(f"{what} has {samples} samples, fewer than one batch for each process "
                        f"({batch_size} x {accelerator.num_processes} processes): lower batch_size")


class TensorBatches(TensorDataset):
    """A TensorDataset that the DataLoader reads a batch at a time (`__getitems__`): one indexing
    operation per batch, no collate. Its tensors may live on the GPU: the sampler still picks
    the indices (sharding, shuffling, resume are unchanged), and only they are copied per step."""

    def __getitems__(self, indices):
        indices = torch.as_tensor(indices)
        if self.tensors[0].is_cuda:  # a plain copy to the GPU would wait for all its queued work
            indices = indices.pin_memory().to(self.tensors[0].device, non_blocking=True)
        return tuple(t[indices] for t in self.tensors)


def class_labels(split, column, num_classes, where):
    """A datasets split's label column as int64 class indices, read as one column, or a
    DataError naming the column's type or the label out of range."""
    labels = split.select_columns([column]).with_format("numpy")[:][column]
    if labels.dtype.kind not in "iu":
        raise DataError(f"{where}'s column {column!r} holds {split.features[column]}, not class indices: "
                        f"map the labels to integers 0..{num_classes - 1}")
    labels = torch.from_numpy(labels).long()
    if labels.min() < 0 or labels.max() >= num_classes:
        bad = int(labels.max() if labels.max() >= num_classes else labels.min())
        raise DataError(f"{where} has label {bad}; labels must be 0..{num_classes - 1}")
    return labels
