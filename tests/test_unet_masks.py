"""The U-Net's data: where it is, mask values and the classes inferred from them, files that do
not read (one line that names the file, on every rank, within seconds), images of mixed sizes and
their padding, and what the loaders read (the image cache, crops and flips)."""

import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import (
    FAST,
    LR,
    N_IMAGES,
    N_VAL,
    ONE_THREAD,
    REPO,
    SIZE,
    VAL_FRACTION,
    assert_ok,
    garble,
    launch,
    predict_here,
    read_metrics,
    truncate,
)
from PIL import Image
from recipe_module import load_recipe

from common.data import DataError
from common.segmentation.augment import colour_jitter, crop_and_flip, zoom_and_rotate
from common.segmentation.data import (
    IGNORE,
    STORED_IGNORE,
    SegmentationSet,
    pad_collate,
    scan_pairs,
    value_count,
)
from common.segmentation.metrics import confusion_counts
from unet_data import Pairs, list_pairs

RECIPE = "recipes/unet.py"
N_TRAIN = N_IMAGES - N_VAL  # the training images of `shapes`
# The runs that meet a bad file: narrower (base_channels 8) and in batches of 4.
UNET_FAST = ["--base_channels", 8, "--val_fraction", 0.2, "--eval_batch_size", 4, "--batch_size", 4]


# ---- Where the data is ----


def test_missing_default_data_says_how_to_make_it(unet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = "data/shapes does not exist yet: write it with `make data/shapes`"
    with pytest.raises(DataError, match=re.escape(message)):
        list_pairs(unet.Config())


def test_a_missing_unet_folder_says_so_and_names_the_layout(unet, tmp_path):
    missing = tmp_path / "no_such_data"
    with pytest.raises(DataError, match=re.escape(f"dataset path {missing} does not exist")) as e:
        list_pairs(unet.Config(dataset=str(missing)))
    assert "imgs/" in str(e.value) and "masks/" in str(e.value), e.value


# ---- Mask values, and the classes found in them ----


def pair(unet, root, index, which):
    """The image (which=0) or mask (1) file of training pair `index` (scan_pairs gives rank r the
    pairs r, r + 2, ...), or of validation pair `index - 100`."""
    train, val = list_pairs(unet.Config(dataset=str(root), val_fraction=0.2))
    return (train[index] if index < 100 else val[index - 100])[which]


def copy_with_a_bad_mask(shapes, unet, root, change):
    """A copy of the data where change() alters the mask that the second process reads first."""
    shutil.copytree(shapes, root)
    bad = pair(unet, root, 1, 1)
    change(Image.open(bad)).save(bad)
    return bad


@pytest.fixture(scope="module")
def bad_shapes(shapes, unet, tmp_path_factory):
    """The mask that the second process reads first holds the value 7."""

    def with_7(mask):
        return Image.fromarray(np.where(np.arange(SIZE) == 3, 7, mask).astype(np.uint8))

    root = tmp_path_factory.mktemp("bad_shapes") / "data"
    return root, copy_with_a_bad_mask(shapes, unet, root, with_7)


@pytest.mark.slow
def test_a_mask_value_outside_mask_values_stops_every_rank_with_one_line(bad_shapes, tmp_path):
    root, bad = bad_shapes
    res = launch(
        [
            RECIPE,
            "--dataset",
            root,
            "--output_dir",
            tmp_path,
            "--mask_values",
            "0,85,170,255",
            "--smoke",
            *FAST,
        ],
        nproc=2,
    )
    # Rank 1 reads the bad mask, yet the error is printed, and only rank 0 prints: the problem
    # reached rank 0 through the gather. The launcher then reports the failed ranks.
    assert res.returncode != 0, res
    assert "terminate called" not in res.output and "DataError" not in res.output, res
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: mask {bad} has value 7, which is not one of mask_values "
        f"0,85,170,255: fix the mask, list the value in --mask_values, or leave it out with "
        f"--ignore_index 7"
    ], res


@pytest.mark.slow
def test_a_mask_that_does_not_fit_its_image_is_named(shapes, unet, tmp_path):
    # What the scan says; the launch above shows that what rank 1 finds reaches the user once.
    from common.accelerator import build_accelerator

    bad = copy_with_a_bad_mask(
        shapes, unet, tmp_path / "data", lambda m: m.resize((SIZE, SIZE - 1))
    )
    message = f"mask {bad} is {SIZE}x{SIZE - 1}, its image {SIZE}x{SIZE}"
    with pytest.raises(DataError, match=re.escape(message)):
        scan_pairs(
            build_accelerator(),
            [
                Pairs(listed)
                for listed in list_pairs(
                    unet.Config(dataset=str(tmp_path / "data"), val_fraction=VAL_FRACTION)
                )
            ],
        )


def data_error(unet, **settings):
    """The one-line DataError that the recipe's load_data() stops with: a launch would print it
    as `error: ...` (test_a_mask_value_outside_mask_values_stops_every_rank_with_one_line)."""
    from common.accelerator import build_accelerator

    cfg = unet.Config(val_fraction=VAL_FRACTION, **settings)
    with pytest.raises(DataError) as e:
        unet.load_data(cfg, build_accelerator())
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.slow
def test_an_odd_mask_value_found_by_inference_is_named(bad_shapes, unet):
    # num_classes left at 0 (one class per value found): a value in a single mask is not a class.
    root, bad = bad_shapes
    error = data_error(unet, dataset=str(root))
    assert (
        f"the masks hold 5 values (0,7,85,170,255); the rarest, 7, is in 1 of {N_IMAGES} "
        f"masks, such as {bad}"
        in error
        and "or --num_classes 5 to keep them all" in error
    )
    # With num_classes set, the count must fit it.
    error = data_error(unet, dataset=str(root), num_classes=4)
    assert "the masks hold 5 values (0,7,85,170,255) where num_classes 4 expects 4" in error
    assert f"the rarest, 7, is in 1 mask(s), such as {bad}" in error


@pytest.mark.slow
def test_num_classes_comes_from_the_masks_in_the_carvana_layout(unet, shapes, tmp_path):
    # imgs/ + masks/ whose masks hold 0 and 255, and no --num_classes: two classes, not an error.
    from common.accelerator import build_accelerator

    root = tmp_path / "binary"
    shutil.copytree(shapes, root)
    for mask in (root / "masks").glob("*.png"):
        binary = np.where(np.asarray(Image.open(mask)) > 0, 255, 0).astype(np.uint8)
        Image.fromarray(binary).save(mask)
    cfg = unet.Config(dataset=str(root), val_fraction=VAL_FRACTION, num_workers=0)
    data = unet.load_data(cfg, build_accelerator())
    assert data.values == [0, 255] and data.num_classes == 2
    assert "classes: mask values 0,255" in str(data)


@pytest.mark.slow
def test_binary_masks_from_a_datasets_folder(shapes, tmp_path):
    """The other data path (parquet files with image and mask columns) and the 1-class model:
    masks of 0/255, resize, crop, bilinear upsampling and the plateau schedule, then predict."""
    import datasets

    images, masks = (sorted((shapes / folder).glob("*.png")) for folder in ("imgs", "masks"))
    binary = [
        Image.fromarray(np.where(np.asarray(Image.open(m)) > 0, 255, 0).astype(np.uint8))
        for m in masks
    ]
    features = datasets.Features({"image": datasets.Image(), "mask": datasets.Image()})
    for split, rows in (("train", slice(0, 40)), ("validation", slice(40, 51))):
        columns = {"image": [str(p) for p in images[rows]], "mask": binary[rows]}
        ds = datasets.Dataset.from_dict(columns, features)
        ds.to_parquet(str(tmp_path / f"{split}.parquet"))
    out = tmp_path / "out"
    res = launch(
        [
            RECIPE,
            "--dataset",
            tmp_path,
            "--output_dir",
            out,
            "--smoke",
            "--num_classes",
            1,
            "--image_size",
            40,
            "--crop_size",
            32,
            "--bilinear",
            "--scheduler",
            "plateau",
            *FAST,
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert (
        "40 train / 11 validation images of 40x40; classes: mask values 0,255 (one sigmoid "
        "output)" in res.output
    )
    (row,) = read_metrics(out)
    assert row["eval_samples"] == 11 and row["step"] == 5 and row["lr"] == LR
    assert 0 <= row["dice"] <= 1
    predict_here(load_recipe("unet"), out / "model.safetensors", images[60], out)
    mask = Image.open(out / f"{images[60].stem}_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= {0, 255}


# ---- Files that do not read ----


@pytest.mark.slow
@pytest.mark.parametrize(
    "which, change",
    [(1, truncate), (1, garble), (0, garble)],
    ids=["truncated mask", "garbage mask", "garbage image"],
)
def test_a_bad_file_found_by_the_scan_is_named(which, change, unet, shapes, tmp_path):
    # What the scan says; rank 1's file, whose problem reaches rank 0 through the same gather as
    # a mask value's (test_a_mask_value_outside_mask_values_stops_every_rank_with_one_line).
    from common.accelerator import build_accelerator

    shutil.copytree(shapes, tmp_path / "data")
    bad = pair(unet, tmp_path / "data", 1, which)
    change(bad)
    kind = ("image", "mask")[which]
    with pytest.raises(DataError, match=re.escape(f"cannot read {kind} {bad} (")):
        scan_pairs(
            build_accelerator(),
            [
                Pairs(listed)
                for listed in list_pairs(
                    unet.Config(dataset=str(tmp_path / "data"), val_fraction=0.2)
                )
            ],
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


def read_every_batch(unet, root, **settings):
    """load_data() of the recipe, and every batch of its loaders read, as training and evaluation
    read them."""
    from common.accelerator import build_accelerator

    cfg = unet.Config(dataset=str(root), val_fraction=0.2, batch_size=4, eval_batch_size=4)
    data = unet.load_data(replace(cfg, **settings), build_accelerator())
    for loader in (data.train_loader, data.val_loader):
        for _ in loader:
            pass


@pytest.mark.slow
def test_a_truncated_image_is_named_when_the_loader_reads_it(unet, truncated_image):
    # In the training process (no workers); a worker's: below. A launch prints it as one line
    # (test_mnist_bad_data.py's 2-process launch).
    root, bad = truncated_image
    message = f"cannot read image {bad} (image file is truncated): fix or remove the file"
    with pytest.raises(DataError, match=re.escape(message)):
        read_every_batch(unet, root, num_workers=0, cache_images=False)


@pytest.mark.slow
def test_a_truncated_image_read_by_a_worker_is_named_and_the_run_exits_at_once(
    truncated_image, tmp_path
):
    # Two loaders with a persistent worker each: torch's own shutdown after the error waited 5 s
    # for each worker, so the process lingered 10 s after its error line.
    root, bad = truncated_image
    cmd = [
        sys.executable,
        RECIPE,
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
def test_a_truncated_image_is_named_as_the_cache_fills(unet, truncated_image):
    # Every process decodes every image into its cache, in the same order, before training: each
    # finds the same first bad file, and rank 0 says it, as MNIST's decoding does (2 processes:
    # test_mnist_bad_data.py).
    root, bad = truncated_image
    message = f"cannot read image {bad} (image file is truncated): fix or remove the file"
    with pytest.raises(DataError, match=re.escape(message)):
        read_every_batch(unet, root, num_workers=0, cache_images=True)


# ---- Images of mixed sizes, and padding ----


@pytest.mark.slow
def test_without_bucket_by_size_mixed_sizes_say_what_to_set(mixed_shapes, unet):
    error = data_error(unet, dataset=str(mixed_shapes))
    assert "images have different sizes" in error
    assert "set --image_size to resize them, or --bucket_by_size true" in error


@pytest.mark.parametrize("num_classes", [4, 1])
def test_padding_changes_neither_the_loss_nor_the_dice_counts(unet, num_classes):
    torch.manual_seed(0)
    logits = torch.randn(1, num_classes, 20, 24)
    target = torch.randint(0, value_count(num_classes), (1, 20, 24))
    other = (torch.zeros(3, 40, 30, dtype=torch.uint8), torch.zeros(40, 30, dtype=torch.int64))
    x, y = pad_collate([(torch.ones(3, 20, 24, dtype=torch.uint8), target[0]), other], 16)
    assert x.shape == (2, 3, 48, 32) and y.shape == (2, 48, 32)  # the largest, rounded up to 16
    assert (y[0, 20:] == IGNORE).all() and (y[0, :, 24:] == IGNORE).all()
    assert (x[0, :, 20:] == 0).all()
    padded_logits = 10 * torch.randn(2, num_classes, 48, 32)  # whatever it says about the padding
    padded_logits[0, :, :20, :24] = logits[0]
    loss, padded_loss = (
        unet.loss_per_image(lg, t, num_classes=num_classes)[0]
        for lg, t in ((logits, target), (padded_logits, y))
    )
    assert padded_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for a, b in zip(
        unet.dice_counts(confusion_counts(logits, target, num_classes), num_classes),
        unet.dice_counts(confusion_counts(padded_logits, y, num_classes), num_classes),
    ):
        assert torch.equal(a[0], b[0])


# ---- What the loaders read: the image cache, crops and flips ----


def epoch_batches(unet, cfg, epoch):
    """The training batches of an epoch, from the recipe's loader as its main() builds it, with
    the settings it settles (hflip auto among them), and augmented as its train_one_epoch()
    augments them."""
    from common.accelerator import build_accelerator

    cfg, data, _ = unet.settle(cfg, build_accelerator())  # hflip auto settled as main() does
    # The order: the loader's first, from its own seeded generator.
    data.train_loader.dataset.epoch = epoch
    return data.reading, [unet.augment(*batch, cfg) for batch in data.train_loader]


@pytest.mark.slow
def test_cached_and_decoded_batches_are_identical_with_any_number_of_workers(unet, shapes):
    settings = dict(dataset=str(shapes), val_fraction=VAL_FRACTION, batch_size=8, crop_size=40)
    settings.update(vflip=0.5, zoom=0.25, rotate=15, jitter=0.3, copy_paste=0.5)
    reading, cached = epoch_batches(unet, unet.Config(**settings, cache_images=True), epoch=3)
    assert reading == "images decoded once, 1 MB in cpu memory"
    for workers in (0, 2, -1):  # -1, the default: one per CPU core less one, at most 8
        streamed = unet.Config(**settings, cache_images=False, num_workers=workers)
        reading, decoded = epoch_batches(unet, streamed, 3)
        count = workers if workers >= 0 else min(8, max(1, len(os.sched_getaffinity(0)) - 1))
        where = (
            f"by {count} DataLoader worker(s) per process" if count else "in the training process"
        )
        assert reading == f"images decoded at every read {where}"
        assert len(decoded) == len(cached) == math.ceil(N_TRAIN / 8)
        for (x, y), (x2, y2) in zip(cached, decoded):
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, 40, 40) and y.dtype == torch.int64
            assert torch.equal(x, x2) and torch.equal(y, y2)
    _, other_epoch = epoch_batches(unet, unet.Config(**settings, cache_images=True), epoch=4)
    # New crops every epoch.
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(cached, other_epoch))


def test_copy_paste_gives_a_share_of_the_samples_the_objects_of_another_picked_by_its_seed():
    # 40 images of 8x8, image i all grey level i; in mask i, on background 0, a 2x2 object of
    # class 1 + i % 3 at a place of its own, and one ignored pixel beside it (a void band).
    n = 40
    images = torch.arange(n, dtype=torch.uint8)[:, None, None, None].expand(n, 3, 8, 8).clone()
    masks = torch.zeros(n, 8, 8, dtype=torch.uint8)
    for i in range(n):
        top, left = i % 7, (i // 7) % 6
        masks[i, top : top + 2, left : left + 2] = 1 + i % 3
        masks[i, top, left + 2] = STORED_IGNORE
    samples = SegmentationSet(
        range(n), None, "RGB", None, seed=3, randoms=True, cache=(images, masks)
    )
    samples.epoch = 2
    _, plain_masks, plain_rand = samples.__getitems__(list(range(n)))
    samples.paste = (0.5, 0)  # as settle() sets it: the share, and the background class
    x, y, rand = samples.__getitems__(list(range(n)))
    assert torch.equal(rand, plain_rand)  # the other augmentations' numbers stay as they were
    _, partners = samples.seeded(list(range(n)))
    pasted = dict(partners)
    assert 12 <= len(pasted) <= 28 and all(pasted[k] != k for k in pasted)  # half, never itself
    for k in range(n):  # pasted: j's object and void on k; the others as they were read
        j = pasted.get(k, k)
        on = masks[j] != 0  # every pixel of the other's that is not background, the void too
        classes = masks[j].long().masked_fill(masks[j] == STORED_IGNORE, IGNORE)
        assert on.sum() == 5 and torch.equal(x[k, :, on], images[j, :, on]), k
        assert torch.equal(y[k, on], classes[on]) and (y[k, on] == IGNORE).sum() == 1
        assert torch.equal(x[k, :, ~on], images[k, :, ~on])
        assert torch.equal(y[k, ~on], plain_masks[k, ~on])
    # Per sample: the same in any batches, in any order, so on any number of processes.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    for batch in (order[:13], order[13:]):
        x2, y2, _ = samples.__getitems__(batch)
        assert torch.equal(x2, x[batch]) and torch.equal(y2, y[batch])
    samples.epoch = 3  # other pairs in another epoch
    assert dict(samples.seeded(list(range(n)))[1]) != pasted
    samples.paste = (0.0, 0)
    assert torch.equal(samples.__getitems__(list(range(n)))[0], images)


def test_crop_and_flip_crop_and_flip_each_image_and_its_mask_alike():
    images = torch.arange(4 * 3 * 6 * 8, dtype=torch.int64).reshape(4, 3, 6, 8)
    masks = images[:, 0] * 10
    rand = torch.tensor(
        [[0.0, 0.0, 0.9, 0.9], [0.999, 0.999, 0.1, 0.9], [0.5, 0.5, 0.9, 0.1], [0.3, 0.7, 0.1, 0.1]]
    )
    x, y = crop_and_flip(images, masks, rand, crop=4, hflip=0.5, vflip=0.5)
    # (top, left) = floor(rand * (6 - 4 + 1)), floor(rand * (8 - 4 + 1)); flipped where rand < 0.5.
    cases = [(0, 0, []), (2, 4, [-1]), (1, 2, [-2]), (0, 3, [-1, -2])]
    for n, (top, left, flips) in enumerate(cases):
        window = images[n, :, top : top + 4, left : left + 4]
        expected = window.flip(flips) if flips else window
        assert torch.equal(x[n], expected) and torch.equal(y[n], expected[0] * 10), n
    assert crop_and_flip(images, masks, rand) == (images, masks)  # nothing to do


def test_zoom_and_rotate_move_each_image_and_its_mask_alike_and_ignore_what_comes_in():
    images = torch.arange(2 * 64, dtype=torch.uint8).reshape(2, 1, 8, 8)
    masks = torch.arange(2 * 64).reshape(2, 8, 8) % 5
    masks[:, 0, 0] = IGNORE
    plain = torch.full_like(images, 200)  # bilinear resampling leaves it as it is, edges too
    # rand[n]: zoom factor, angle, and where the image lies; 0.5 is factor 1, angle 0, centred.
    same = zoom_and_rotate(images, masks, torch.full((2, 4), 0.5), zoom=0.5, rotate=30)
    assert torch.equal(same[0], images) and torch.equal(same[1], masks)  # ignored stays ignored
    # Rotated by +90 degrees, exactly: a quarter turn of the pixel grid, image and mask alike.
    x, y = zoom_and_rotate(images, masks, torch.tensor([[0.5, 1.0, 0.5, 0.5]] * 2), rotate=90)
    assert torch.equal(x, images.rot90(1, (2, 3))) and torch.equal(y, masks.rot90(1, (1, 2)))
    # Zoomed in 2x (zoom 1: factors 0.5 to 2), at the top left: that quarter, each pixel 2x2.
    rand = torch.tensor([[1.0, 0.5, 0.0, 0.0]] * 2)
    x, y = zoom_and_rotate(plain, masks, rand, zoom=1)
    assert torch.equal(y, masks[:, :4, :4].repeat_interleave(2, 1).repeat_interleave(2, 2))
    assert torch.equal(x, plain)
    # Zoomed out 2x, centred: the image in the middle half, and around it IGNORE in the mask, so
    # that the loss and the metrics skip it; in the image, by default, the image mirrored across
    # its edges (no black frame that held-out images never have), or zeros with fill="zeros".
    small = masks[:, :4, :4]
    blocks = small.repeat_interleave(2, 1).repeat_interleave(2, 2)  # each class 2x2 pixels
    out = torch.tensor([[0.0, 0.5, 0.5, 0.5]] * 2)
    border = torch.ones(8, 8, dtype=torch.bool)
    border[2:6, 2:6] = False
    even = images * 2  # the mean of 2x2 of its pixels, what bilinear takes here, is a whole number
    x, y = zoom_and_rotate(even, blocks, out, zoom=1)
    assert (y[:, border] == IGNORE).all()
    assert torch.equal(y[:, 2:6, 2:6], small)  # nearest neighbour: whole classes
    inner = x[:, :, 2:6, 2:6]
    assert torch.equal(x[:, :, 2:6, :2], inner[..., :2].flip(3))  # the left edge's mirror
    assert torch.equal(x[:, :, 2:6, 6:], inner[..., 2:].flip(3))  # the right edge's
    assert torch.equal(x[:, :, :2, 2:6], inner[:, :, :2].flip(2))  # the top edge's
    assert len(inner.unique()) == 32  # a picture, not a colour that any mirror leaves alike
    x, y = zoom_and_rotate(plain, blocks, out, zoom=1, fill="zeros")
    assert (y[:, border] == IGNORE).all() and (x[:, 0, border] == 0).all()
    assert torch.equal(y[:, 2:6, 2:6], small) and (x[:, 0, 2:6, 2:6] == 200).all()
    assert zoom_and_rotate(images, masks, torch.rand(2, 4)) == (images, masks)  # nothing to do


def test_colour_jitter_scales_brightness_contrast_and_saturation_per_image():
    torch.manual_seed(0)
    images = torch.randint(0, 256, (3, 4, 5, 6), dtype=torch.uint8)  # RGBA
    # rand[n]: brightness, contrast, saturation; 0.5 is a factor of 1.
    assert torch.equal(colour_jitter(images, torch.full((3, 3), 0.5), 0.4), images)
    assert colour_jitter(images, torch.rand(3, 3), 0.0) is images  # nothing to do
    rand = torch.tensor([[1.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])
    x = colour_jitter(images, rand, 0.5).float()
    rgb = images[:, :3].float()
    assert torch.equal(x[0, :3], (rgb[0] * 1.5).clamp(max=255).round())  # brighter
    grey = (rgb * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1)
    # Half the contrast: every pixel halfway to the image's mean grey.
    assert torch.allclose(x[1, :3], ((rgb[1] + grey[1].mean()) / 2).round(), atol=1)
    # Half the saturation: each pixel halfway to its own grey.
    assert torch.allclose(x[2, :3], ((rgb[2] + grey[2]) / 2).round(), atol=1)
    assert torch.equal(x[:, 3], images[:, 3].float())  # alpha stays
    grey_images = images[:, :1]  # one channel: brightness and contrast only
    assert torch.equal(colour_jitter(grey_images, rand, 0.5)[2], grey_images[2])
