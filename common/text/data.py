"""Documents for a text classifier: listed from folders or tables, split by their content,
checked, held as token ids, and batched by length on any number of processes.

    train, test, classes, notes = folder_splits("data/spam", val_fraction=0.2)  # or table_splits
    check_splits(train, test, classes)              # one-line errors: empty documents, ...
    train_set = TokenSet(tokenizer.encode(train.texts), train.labels, train.names)
    train_loader = train_loader_by_length(train_set, accelerator=..., max_batch_tokens=...)
    test_loader = test_loader_by_length(test_set, accelerator=..., max_batch_tokens=...)

Folders: root/train/<class>/* and root/test/<class>/* (any file names, read as bytes), or one
folder per class, root/<class>/*, of which a share (val_fraction) is held out by a hash of each
document's content, so that identical documents fall on the same side. Tables: what
datasets.load_dataset reads (parquet, CSV, JSON lines, a hub name), with a text column and a
label column; without a test split the same hash holds out a share of the training split.
Everything is read into memory at start-up, on every process alike, so bad data stops every
process with the same one-line error.
"""

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.data import DATA_SUFFIXES, DataError, load_splits, seeded_loader
from common.sampler import (
    BucketBatchSampler,
    GlobalBucketSampler,
    rounded_lengths,
    sharded_loader,
)


@dataclass
class Documents:
    """A split: each document's name (its file, or its row), its bytes and its class index."""

    names: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    labels: list = field(default_factory=list)

    def add(self, name, text, label):
        self.names.append(name)
        self.texts.append(text)
        self.labels.append(label)

    def __len__(self):
        return len(self.texts)


# ---- Folders ----


def holds_tables(root):
    """True if the folder `root` holds table files (parquet, CSV, JSON: datasets.load_dataset
    reads those), anywhere in it; False for a folder of documents."""
    return any(p.suffix in DATA_SUFFIXES and p.is_file() for p in Path(root).rglob("*"))


def visible(folder):
    """The entries of a folder but hidden ones (.DS_Store, .git), sorted."""
    return sorted(p for p in Path(folder).iterdir() if not p.name.startswith("."))


def class_folders(root):
    return [p for p in visible(root) if p.is_dir()]


def read_bytes(path):
    """The bytes of a file, or a DataError naming it."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DataError(
            f"cannot read {path} ({e.strerror or e}): fix its permissions, or remove it"
        ) from None


def read_folder(root, classes):
    """The documents of root/<class>/** for each class name (class index: its place in
    `classes`), files in sorted order."""
    docs = Documents()
    for label, name in enumerate(classes):
        folder = Path(root) / name
        files = [p for p in sorted(folder.rglob("*")) if not p.is_dir()] if folder.is_dir() else []
        hidden = [p for p in files if any(x.startswith(".") for x in p.relative_to(folder).parts)]
        files = [p for p in files if p not in set(hidden)]
        for path in files:
            docs.add(str(path), read_bytes(path), label)
    return docs


def folder_splits(root, *, train_split="train", test_split="test", val_fraction=0.2):
    """(train, test, classes, notes) of a folder: root/train/<class>/* with root/test/<class>/*
    (classes: the training folders' names, sorted), or root/<class>/* with val_fraction of it
    held out by content (content_split). notes: start-up lines on how it was split."""
    root = Path(root)
    train_root, test_root = root / train_split, root / test_split
    if train_root.is_dir() and class_folders(train_root):
        classes = [p.name for p in class_folders(train_root)]
        if not test_root.is_dir():
            train, test = content_split(read_folder(train_root, classes), val_fraction)
            return train, test, classes, [held_out_note(root / train_split, val_fraction)]
        unknown = [p.name for p in class_folders(test_root) if p.name not in classes]
        if unknown:
            raise DataError(
                f"{test_root / unknown[0]} is a class that {train_root} does not have (it has "
                f"{', '.join(classes)}): a model cannot learn a class without training documents; "
                f"add {train_root / unknown[0]}/ or remove the test folder"
            )
        return read_folder(train_root, classes), read_folder(test_root, classes), classes, []
    classes = [p.name for p in class_folders(root)]
    if not classes:
        raise DataError(
            f"{root} has no class folders: put each class's documents in {root}/<class>/, or in "
            f"{train_root}/<class>/ and {test_root}/<class>/"
        )
    docs = read_folder(root, classes)
    for label, name in enumerate(classes):
        count = docs.labels.count(label)
        if count < 2:
            raise DataError(
                f"class {name} ({root / name}) has {count} document{'s' * (count != 1)}: a class "
                f"needs one to train on and one to test with at least; add documents, or remove "
                f"the folder"
            )
    train, test = content_split(docs, val_fraction)
    return train, test, classes, [held_out_note(root, val_fraction)]


def held_out_note(where, val_fraction):
    return (
        f"test split: {val_fraction:g} of {where} held out by a hash of each document's content "
        f"(identical documents on one side)"
    )


def content_split(docs, val_fraction):
    """(train, test): a document goes to test when the hash of its bytes falls in the first
    val_fraction of the hash range: a fixed split, the same for any seed and any file names,
    with identical documents on the same side (a split by file name leaks duplicates)."""
    train, test = Documents(), Documents()
    for name, text, label in zip(docs.names, docs.texts, docs.labels):
        share = int.from_bytes(hashlib.sha256(text).digest()[:8], "big") / 2**64
        (test if share < val_fraction else train).add(name, text, label)
    return train, test


# ---- Tables ----


def table_splits(
    dataset,
    *,
    text_column="text",
    label_column="label",
    train_split="train",
    test_split="test",
    val_fraction=0.2,
    hint=None,
):
    """(train, test, classes, notes) of what datasets.load_dataset reads: a text column (str, or
    binary: bytes as they are) and a label column (a ClassLabel, whose names are the classes;
    ints 0..; or names). Without a `test_split`, val_fraction of the training split is held out
    by content (content_split)."""
    columns = [text_column, label_column]
    try:
        splits = load_splits(dataset, [train_split, test_split], columns, hint=hint)
    except DataError as e:
        if f"no {test_split!r} split" not in str(e):
            raise
        splits = load_splits(dataset, [train_split], columns, hint=hint)
    train_rows = splits[train_split]
    classes = table_classes(train_rows, label_column, f"{dataset} {train_split} split")
    train = table_documents(train_rows, text_column, label_column, classes, f"{train_split} row")
    if test_split not in splits:
        train, test = content_split(train, val_fraction)
        return (
            train,
            test,
            classes,
            [held_out_note(f"{dataset}'s {train_split} split", val_fraction)],
        )
    test_rows = splits[test_split]
    test = table_documents(test_rows, text_column, label_column, classes, f"{test_split} row")
    return train, test, classes, []


def table_classes(rows, column, where):
    """The class names of a label column: its ClassLabel's names, "0".."largest" for ints, or
    the sorted names of a text column."""
    import datasets

    feature = rows.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    labels = [v for v in rows[column] if v is not None]
    if not labels:
        raise DataError(f"{where}'s column {column!r} holds no labels")
    if all(isinstance(v, str) for v in labels):
        return sorted(set(labels))
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in labels):
        if min(labels) < 0:
            raise DataError(f"{where} has label {min(labels)}; labels must be 0 or more, or names")
        return [str(i) for i in range(max(labels) + 1)]
    raise DataError(
        f"{where}'s column {column!r} holds {feature}, not class indices or names: check "
        f"--label_column"
    )


def table_documents(rows, text_column, label_column, classes, where):
    """The rows of a split as Documents named `where N`; a label that is not one of `classes`
    (as the training split has them) stops with a DataError."""
    import datasets

    feature = rows.features[label_column]
    if isinstance(feature, datasets.ClassLabel):  # its names are the classes, by index
        names = feature.names
    else:  # names, or ints 0.. named "0".."N"
        names = None
    index = {name: i for i, name in enumerate(classes)}
    docs = Documents()
    for i, (text, label) in enumerate(zip(rows[text_column], rows[label_column])):
        name = f"{where} {i}"
        if text is None or label is None:
            raise DataError(
                f"{name} holds no {'text' if text is None else 'label'}: fix or remove it"
            )
        if isinstance(text, str):
            text = text.encode("utf-8")
        elif not isinstance(text, bytes):
            raise DataError(
                f"{name}'s column {text_column!r} holds {type(text).__name__}, not text: check "
                f"--text_column"
            )
        key = names[label] if names else str(label)
        if key not in index:
            raise DataError(
                f"{name} has label {label!r}, which the training split never has (it has "
                f"{', '.join(classes)}): a model cannot learn a class without training documents"
            )
        docs.add(name, text, index[key])
    return docs


# ---- Checks ----


def check_splits(train, test, classes):
    """One-line errors for data that cannot train: an empty document, a class with no training
    document. Returns the start-up notes: test documents identical to training ones, classes
    with no test document."""
    for docs in (train, test):
        empty = [n for n, t in zip(docs.names, docs.texts) if not t]
        if empty:
            more = (
                f" (and {len(empty) - 1} more; --check_data lists them)" if len(empty) > 1 else ""
            )
            raise DataError(f"{empty[0]} is empty{more}: remove it, or give it its text")
    counts = [np.bincount(d.labels, minlength=len(classes)) for d in (train, test)]
    for name, trained in zip(classes, counts[0]):
        if not trained:
            raise DataError(
                f"class {name} has no training document: a model cannot learn it; add some, or "
                f"remove the class"
            )
    notes = []
    untested = [name for name, tested in zip(classes, counts[1]) if not tested]
    if untested:
        notes.append(
            f"note: no test document of class {', '.join(untested)}: its accuracy is not measured"
        )
    leaked = len(duplicates_across(train, test))
    if leaked:
        notes.append(
            f"note: {leaked} test documents are identical to training documents, which flatters "
            f"the test accuracy: hold out by content (one folder per class with val_fraction)"
        )
    return notes


def digests(docs):
    return [hashlib.sha256(t).digest() for t in docs.texts]


def duplicates_across(train, test):
    """The names of the test documents whose bytes equal a training document's."""
    seen = set(digests(train))
    return [n for n, d in zip(test.names, digests(test)) if d in seen]


def duplicate_groups(docs):
    """Groups (lists of names) of the documents of a split whose bytes are the same."""
    groups = {}
    for name, digest in zip(docs.names, digests(docs)):
        groups.setdefault(digest, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def not_utf8(docs):
    """The names of the documents that are not valid UTF-8 (bytes tokens read them as they are)."""
    bad = []
    for name, text in zip(docs.names, docs.texts):
        try:
            text.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(name)
    return bad


def cut_note(lengths, max_length, unit):
    """The start-up line that says what max_length does to the training documents."""
    lengths = np.asarray(lengths)
    if not max_length:
        return (
            f"max_length 0: whole documents, up to {lengths.max():,} {unit} "
            f"(median {int(np.median(lengths)):,})"
        )
    longer = (lengths > max_length).mean()
    return (
        f"max_length {max_length:,} {unit}: {longer:.1%} of the training documents are longer "
        f"(the longest {lengths.max():,}); each is cut to its first {max_length:,}"
    )


def length_summary(lengths, max_length, unit):
    """The data check's line on a split's lengths: quantiles, and what max_length cuts."""
    lengths = np.asarray(lengths)
    median, p90, p99 = (int(np.percentile(lengths, q)) for q in (50, 90, 99))
    line = (
        f"lengths in {unit}: median {median:,}, 90% up to {p90:,}, 99% up to {p99:,}, the "
        f"longest {lengths.max():,}"
    )
    if max_length:
        line += f"; {(lengths > max_length).mean():.1%} longer than max_length {max_length:,}"
    return line


# ---- Token ids in memory, and batches by length ----


class TokenSet(torch.utils.data.Dataset):
    """Documents as token ids (0: padding), all in one array, with their labels. The DataLoader
    reads a whole batch at once (__getitems__): int64 token ids [N, L], padded with 0 to the
    batch's longest document rounded up to `multiple`, and int64 labels [N]."""

    def __init__(self, tokens, labels, names, multiple=8):
        self.lengths = np.array([len(t) for t in tokens], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int16)
        self.labels = torch.as_tensor(labels, dtype=torch.int64)
        self.names, self.multiple = list(names), multiple

    def __len__(self):
        return len(self.lengths)

    def __getitems__(self, indices):
        lengths = self.lengths[indices]
        longest = -(-max(int(lengths.max()), 1) // self.multiple) * self.multiple
        x = np.zeros((len(indices), longest), np.int64)
        for row, (start, n) in enumerate(zip(self.starts[indices], lengths)):
            x[row, :n] = self.tokens[start : start + n]
        return torch.from_numpy(x), self.labels[indices]

    def __getitem__(self, i):
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def subset(self, indices):
        """A TokenSet of these documents, in this order."""
        return TokenSet(
            [self.tokens[self.starts[i] : self.starts[i] + self.lengths[i]] for i in indices],
            self.labels[indices],
            [self.names[i] for i in indices],
            self.multiple,
        )

    def sizes(self):
        """Each document's length as the samplers see it (rounded_lengths: ties mix batches)."""
        return rounded_lengths(np.maximum(self.lengths, 1), multiple=self.multiple)


class TokenCount:
    """The real (not padding) and padded tokens of the training batches of every process, counted
    on the device with no host sync; compute() (a collective) gives tokens per second since the
    start, and the share of padding."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.real = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        self.padded = 0
        self.start = time.perf_counter()

    def update(self, tokens):
        self.real += (tokens != 0).sum()
        self.padded += tokens.numel()

    def compute(self):
        padded = torch.tensor(float(self.padded), dtype=torch.float64, device=self.real.device)
        real, padded = self.accelerator.reduce(torch.stack([self.real, padded]), "sum").tolist()
        return {
            "train_tokens_per_s": real / max(time.perf_counter() - self.start, 1e-9),
            "padding": 1 - real / max(padded, 1.0),
        }


def train_loader_by_length(
    train_set,
    *,
    accelerator,
    max_batch_tokens,
    batch_size,
    seed,
    global_batch=0,
    num_workers=0,
):
    """The training loader: batches of similar lengths, the same number on every process.
    Without global_batch: global batches of num_processes x accumulation micro-batches, each at
    most max_batch_tokens padded tokens and batch_size documents, formed by length and then
    split among the processes (common.sampler.GlobalBucketSampler): every document once per
    epoch. With global_batch (global_batch_size): batch_size documents per micro-batch, in the
    order of global batches of that many documents sorted by length (GlobalBatchOrder), the
    same steps on any number of processes, prepared here; len % global_batch documents are
    left out each epoch (others every epoch)."""
    sizes = train_set.sizes()
    if global_batch:
        loader = seeded_loader(
            train_set,
            batch_size,
            shuffle=True,
            seed=seed,
            num_workers=num_workers,
            global_batch=global_batch,
            sizes=sizes,
        )
        return accelerator.prepare(loader)
    sampler = GlobalBucketSampler(
        sizes,
        max_batch_tokens,
        accelerator.num_processes,
        accelerator.process_index,
        seed=seed,
        accumulation=accelerator.gradient_accumulation_steps,
        max_batch_size=batch_size,
    )
    return sharded_loader(
        train_set, sampler, accelerator, collate_fn=tuple, num_workers=num_workers
    )


def test_loader_by_length(test_set, *, accelerator, max_batch_tokens, batch_size, num_workers=0):
    """The evaluation loader: batches of similar lengths (at most max_batch_tokens padded tokens
    and batch_size documents), every document on exactly one process once, no padding: the
    processes may hold different numbers of batches, so evaluate with no collective per batch
    and reduce the sums once (common/sampler.py)."""
    sampler = BucketBatchSampler(
        test_set.sizes(),
        max_batch_tokens,
        accelerator.num_processes,
        accelerator.process_index,
        shuffle=False,
        max_batch_size=batch_size,
        even_batches=False,
    )
    return sharded_loader(test_set, sampler, accelerator, collate_fn=tuple, num_workers=num_workers)


# ---- The data check's picture ----


def length_histogram(splits, path, *, max_length, unit, width=640, height=280):
    """A PNG of the documents' lengths: a bar per quarter of a doubling (log scale) per split
    ({name: lengths}, a colour each), and max_length as a red line."""
    from PIL import Image, ImageDraw

    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44)]
    every = np.maximum(np.concatenate([np.asarray(v) for v in splits.values()]), 1)
    low, high = int(np.floor(np.log2(every.min()))), int(np.ceil(np.log2(every.max() + 1)))
    edges = 2.0 ** np.arange(low, high + 0.125, 0.25)
    counts = {k: np.histogram(np.maximum(v, 1), bins=edges)[0] for k, v in splits.items()}
    top = max(int(c.max()) for c in counts.values()) or 1
    left, bottom, right = 50, height - 40, width - 20
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    slot = (right - left) / (len(edges) - 1)

    def x_of(length):
        return left + (np.log2(length) - low) * 4 * slot

    for s, (name, count) in enumerate(counts.items()):
        colour = colours[s % len(colours)]
        for b, c in enumerate(count):
            x0 = left + b * slot + s * slot / len(counts)
            y = bottom - (bottom - 20) * c / top
            draw.rectangle([x0, y, x0 + slot / len(counts) - 1, bottom], fill=colour)
        draw.text((left + 10, 4 + 12 * s), f"{name}: {len(splits[name])} documents", fill=colour)
    draw.line([left, bottom, right, bottom], fill="black")
    step = 1 if high - low <= 12 else 2  # a label per doubling, or per two
    for power in range(low, high + 1, step):
        x = x_of(2**power)
        draw.line([x, bottom, x, bottom + 4], fill="black")
        label = f"{2**power:,}" if power < 10 else f"{2 ** (power - 10):,}k"
        draw.text((x - 8, bottom + 6), label, fill="black")
    draw.text((left, bottom + 22), f"length in {unit} (log scale); bars: documents", fill="black")
    draw.text((4, 16), f"{top}", fill="black")
    if max_length and every.min() <= max_length <= 2**high:
        x = x_of(max_length)
        draw.line([x, 20, x, bottom], fill="red", width=2)
        draw.text((x + 4, 24), f"max_length {max_length:,}", fill="red")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
