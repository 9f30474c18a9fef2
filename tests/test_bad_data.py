"""Corrupt, unreadable or missing data: one line that names the file (or the path) and the fix,
on every rank, within seconds; never a raw traceback and never a hang."""

import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, assert_ok, launch
from PIL import Image
from recipe_module import load_recipe
from unet_data import open_sources

from common.data import DataError

MNIST, UNET = "recipes/mnist.py", "recipes/unet.py"
UNET_FAST = ["--base_channels", 8, "--val_fraction", 0.2, "--eval_batch_size", 4, "--batch_size", 4]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def error_lines(res):
    """The `error:` lines of a failed run; no rank may show a traceback (the launcher's own one,
    which reports the failed ranks, is not the recipe's)."""
    assert res.returncode != 0, res
    assert "DataError" not in res.output, res
    assert not re.search(r'File ".*/(recipes|common)/', res.output), res
    return [line for line in res.output.splitlines() if line.startswith("error:")]


def assert_one_line(res, *parts):
    """Exit 2 and one line in all, `error: ...` holding each of `parts`."""
    lines = res.output.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res
    assert all(str(p) in lines[0] for p in parts), res
    return lines[0]


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header still reads; the pixels do not


def garble(path):
    path.write_bytes(b"this is not an image nor a parquet file " * 20)


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


@pytest.mark.slow
@pytest.mark.parametrize("change", [garble, truncate])
def test_a_bad_png_in_an_imagefolder_stops_with_one_line_naming_it(change, imagefolder, tmp_path):
    bad = broken_copy(imagefolder, tmp_path / "data", "test/7/017.png", change)
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
        launcher="python",
    )
    line = assert_one_line(res, f"test split: cannot read image {bad} (", "fix or remove the file")
    assert "Traceback" not in res.output, line


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


@pytest.mark.slow
def test_a_clean_imagefolder_trains(imagefolder, tmp_path):
    res = launch(
        [MNIST, "--dataset", imagefolder, "--output_dir", tmp_path, "--smoke", "--batch_size", 8],
        launcher="python",
    )
    assert_ok(res)
    assert "40 train / 40 test samples" in res.output, res


# ---- MNIST: parquet files that do not read ----


@pytest.mark.slow
@pytest.mark.parametrize("file, change", [("train.parquet", truncate), ("test.parquet", garble)])
def test_a_bad_parquet_file_is_named(file, change, tiny_mnist, tmp_path):
    # A bad first file fails as datasets reads the schema; a bad later one as it reads the rows.
    bad = broken_copy(tiny_mnist, tmp_path / "data", file, change)
    res = launch(
        [MNIST, "--dataset", tmp_path / "data", "--output_dir", tmp_path / "out", "--smoke"],
        launcher="python",
    )
    assert_one_line(res, f"cannot read {bad} (", "truncated or not a parquet file")


# ---- where the data is: hub names without internet, mistyped paths ----


@pytest.mark.slow
def test_an_unreachable_hub_name_names_the_local_data_that_works_here(tmp_path):
    res = launch([MNIST, "--output_dir", tmp_path], launcher="python")  # the default, ylecun/mnist
    assert_one_line(
        res,
        "could not load 'ylecun/mnist'",
        "point --dataset at a local folder",
        "--dataset data/mnist_sample",
        "make data/mnist_full",
    )


@pytest.mark.slow
def test_a_mistyped_local_path_says_it_does_not_exist(tmp_path):
    assert (REPO / "data").is_dir()
    res = launch(
        [MNIST, "--dataset", "data/mnist_sampel", "--output_dir", tmp_path], launcher="python"
    )
    line = assert_one_line(res, "dataset path data/mnist_sampel does not exist: check --dataset")
    assert "no internet" not in line and "could not load" not in line


# ---- U-Net: imgs/ + masks/ ----


@pytest.fixture(scope="module")
def unet():
    return load_recipe("unet")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "make_shapes.py",
            "--out",
            root,
            "--count",
            "20",
            "--size",
            "48",
        ],
        check=True,
        capture_output=True,
    )
    return root


def pair(unet, root, index, which):
    """The image (which=0) or mask (1) file of training pair `index` (scan_masks gives rank r the
    pairs r, r + 2, ...), or of validation pair `index - 100`."""
    train, val = open_sources(unet.Config(dataset=str(root), val_fraction=0.2))
    return (train[index] if index < 100 else val[index - 100])[which]


def test_a_missing_unet_folder_says_so_and_names_the_layout(unet, tmp_path):
    missing = tmp_path / "no_such_data"
    with pytest.raises(DataError, match=re.escape(f"dataset path {missing} does not exist")) as e:
        open_sources(unet.Config(dataset=str(missing)))
    assert "imgs/" in str(e.value) and "masks/" in str(e.value), e.value


@pytest.mark.slow
def test_a_bad_file_found_by_the_scan_stops_both_ranks_with_one_line(unet, shapes, tmp_path):
    shutil.copytree(shapes, tmp_path / "data")
    bad = pair(unet, tmp_path / "data", 1, 0)  # rank 1's: its message reaches rank 0, gathered
    garble(bad)
    res = launch(
        [
            UNET,
            "--dataset",
            tmp_path / "data",
            "--output_dir",
            tmp_path / "out",
            "--smoke",
            "--num_workers",
            0,
            *UNET_FAST,
        ],
        nproc=2,
        env=ONE_THREAD,
        timeout=120,
    )
    errors = error_lines(res)
    assert len(errors) == 1 and f"cannot read image {bad} (" in errors[0], res


@pytest.mark.slow
@pytest.mark.parametrize("change", [truncate, garble], ids=["truncated mask", "garbage mask"])
def test_a_bad_mask_found_by_the_scan_is_named(change, unet, shapes, tmp_path):
    # What the scan says; the launch above shows that what rank 1 finds reaches the user once.
    from unet_data import scan_masks

    from common.accelerator import build_accelerator

    shutil.copytree(shapes, tmp_path / "data")
    bad = pair(unet, tmp_path / "data", 1, 1)
    change(bad)
    with pytest.raises(DataError, match=re.escape(f"cannot read mask {bad} (")):
        scan_masks(
            build_accelerator(),
            open_sources(unet.Config(dataset=str(tmp_path / "data"), val_fraction=0.2)),
        )


@pytest.fixture
def truncated_image(unet, shapes, tmp_path):
    """A copy of the shapes whose first validation image is cut short: its header reads, so the
    scan passes it, and it fails when a DataLoader reads it."""
    shutil.copytree(shapes, tmp_path / "data")
    bad = pair(unet, tmp_path / "data", 100, 0)
    truncate(bad)
    Image.open(bad).close()  # the header is fine
    return tmp_path / "data", bad


@pytest.mark.slow
def test_a_truncated_image_stops_with_one_line_without_workers(truncated_image, tmp_path):
    root, bad = truncated_image
    res = launch(
        [
            UNET,
            "--dataset",
            root,
            "--output_dir",
            tmp_path / "out",
            "--smoke",
            "--num_workers",
            0,
            "--cache_images",
            "false",
            *UNET_FAST,
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert res.returncode == 2 and "Traceback" not in res.output, res  # after the start-up lines:
    assert error_lines(res) == [
        f"error: cannot read image {bad} (image file is truncated): fix or remove the file"
    ]


@pytest.mark.slow
def test_a_truncated_image_read_by_a_worker_is_named_and_the_run_exits_at_once(
    truncated_image, tmp_path
):
    # Two loaders with a persistent worker each: torch's own shutdown after the error waited 5 s
    # for each worker, so the process lingered 10 s after its error line.
    root, bad = truncated_image
    cmd = [
        sys.executable,
        UNET,
        "--dataset",
        root,
        "--output_dir",
        tmp_path / "out",
        "--smoke",
        "--num_workers",
        1,
        "--cache_images",
        "false",
        *UNET_FAST,
    ]
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **ONE_THREAD},
    )
    output, said = "", None
    for line in proc.stdout:  # "error:" follows the progress bar's carriage returns on its line
        output += line
        if said is None and "error: " in line:
            said = time.monotonic()
    proc.wait(timeout=60)
    assert said is not None and proc.returncode == 2, output
    assert f"cannot read image {bad} (" in output, output
    assert time.monotonic() - said < 4, "the process lingered after its error line"


@pytest.mark.slow
def test_a_truncated_image_stops_both_ranks_with_one_line_as_they_fill_the_cache(
    truncated_image, tmp_path
):
    # Every process decodes every image into its cache, in the same order: both find the same
    # first bad file before training, and rank 0 says it.
    root, bad = truncated_image
    res = launch(
        [
            UNET,
            "--dataset",
            root,
            "--output_dir",
            tmp_path / "out",
            "--smoke",
            "--cache_images",
            "true",
            *UNET_FAST,
        ],
        nproc=2,
        env=ONE_THREAD,
        timeout=120,
    )
    assert error_lines(res) == [
        f"error: cannot read image {bad} (image file is truncated): fix or remove the file"
    ]
    assert "unet: " not in res.output, res  # stopped before the start-up line: no training began
