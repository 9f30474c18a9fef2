"""MNIST's corrupt, unreadable or missing data: one line that names the file (or the path) and the
fix, on every rank, within seconds; never a raw traceback and never a hang. The U-Net's bad files
are in test_unet_masks.py."""

import re
import shutil
import time

import numpy as np
import pytest
from conftest import REPO, error_lines, garble, launch, truncate
from PIL import Image

from common.data import DataError

MNIST = "recipes/mnist.py"


def write_imagefolder(root, per_split=40):
    """MNIST as an imagefolder: train/<label>/*.png and test/<label>/*.png, 28x28 'L' digits."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for k in range(per_split):
            folder = root / split / str(k % 10)
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            Image.fromarray(pixels, "L").save(folder / f"{k:03d}.png")
    return root


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("imagefolder"))


def broken_copy(src, dst, relative, change):
    shutil.copytree(src, dst)
    change(dst / relative)
    return dst / relative


# ---- MNIST: images that do not decode ----


@pytest.mark.slow
def test_decode_images_matches_datasets_decoding_and_names_a_bad_file(
    imagefolder, tiny_mnist, tmp_path
):
    import datasets

    from common.data import decode_images

    for source in (imagefolder, tiny_mnist):  # files read by path; images stored as bytes
        split = datasets.load_dataset(str(source))["train"]
        ours = decode_images(split, "image", "train split")
        theirs = list(split["image"])
        assert len(ours) == len(theirs) > 0
        assert all(
            a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(ours, theirs)
        )
    bad = broken_copy(imagefolder, tmp_path / "data", "train/3/013.png", garble)
    split = datasets.load_dataset(str(tmp_path / "data"))["train"]
    with pytest.raises(DataError, match=re.escape(f"train split: cannot read image {bad} (")):
        decode_images(split, "image", "train split")


def data_error(dataset, *more):
    """The one-line DataError that MNIST's data step (make_loaders) stops with: a launch prints it
    as `error: ...` (test_a_bad_png_stops_both_ranks_quickly_with_one_line)."""
    from recipe_module import load_recipe

    from common.config import parse_config

    mnist = load_recipe("mnist")
    with pytest.raises(DataError) as e:
        mnist.make_loaders(parse_config(mnist.Config, ["--dataset", str(dataset), *more]))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("change", [garble, truncate])
def test_a_bad_png_in_an_imagefolder_is_named_with_the_fix(change, imagefolder, tmp_path):
    bad = broken_copy(imagefolder, tmp_path / "data", "test/7/017.png", change)
    error = data_error(tmp_path / "data")
    assert (
        error.startswith(f"test split: cannot read image {bad} (")
        and "fix or remove the file" in error
    )


def test_a_bad_png_stops_both_ranks_quickly_with_one_line(imagefolder, tmp_path):
    bad = broken_copy(imagefolder, tmp_path / "data", "train/3/013.png", truncate)
    start = time.monotonic()
    res = launch(
        [
            MNIST,
            "--dataset",
            tmp_path / "data",
            "--output_dir",
            tmp_path / "out",
            "--smoke",
            "--batch_size",
            8,
        ],
        nproc=2,
        timeout=120,
    )
    assert time.monotonic() - start < 60, res
    errors = error_lines(res)
    assert len(errors) == 1 and f"train split: cannot read image {bad} (" in errors[0], res
    # Rank 1 meets the same file, and says nothing: rank 0 said it (common/runtime.py).
    assert "error (rank 1)" not in res.output and "[rank1]" not in res.output, res


# ---- MNIST: parquet files that do not read ----


@pytest.mark.slow
@pytest.mark.parametrize("file, change", [("train.parquet", truncate), ("test.parquet", garble)])
def test_a_bad_parquet_file_is_named(file, change, tiny_mnist, tmp_path):
    # A bad first file fails as datasets reads the schema; a bad later one as it reads the rows.
    bad = broken_copy(tiny_mnist, tmp_path / "data", file, change)
    error = data_error(tmp_path / "data")
    assert f"cannot read {bad} (" in error and "truncated or not a parquet file" in error, error


# ---- where the data is: hub names without internet, mistyped paths ----


@pytest.mark.slow
def test_an_unreachable_hub_name_names_the_local_data_that_works_here():
    error = data_error("ylecun/mnist")  # the default
    for part in (
        "could not load 'ylecun/mnist'",
        "point --dataset at a local folder",
        "--dataset data/mnist_sample",
        "make data/mnist_full",
    ):
        assert part in error, error


@pytest.mark.slow
def test_a_mistyped_local_path_says_it_does_not_exist(monkeypatch):
    monkeypatch.chdir(REPO)  # where data/ is
    assert (REPO / "data").is_dir()
    error = data_error("data/mnist_sampel")
    assert "dataset path data/mnist_sampel does not exist: check --dataset" in error
    assert "no internet" not in error and "could not load" not in error
