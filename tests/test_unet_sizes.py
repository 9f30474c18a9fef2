"""Image sizes as the U-Net takes them: --scale keeps each image's aspect ratio (Carvana at 0.5),
--image_size takes HxW, predict returns every mask at its image's size, large JPEGs decode at
reduced size, and the mask scan is remembered between starts on the same files."""

import os
import sys

import numpy as np
import pytest
import torch
from conftest import (
    FAST,
    ONE_THREAD,
    REPO,
    assert_ok,
    launch,
    make_shapes,
    predict_here,
    read_metrics,
)
from PIL import Image, JpegImagePlugin

from common.config import parse_config
from common.data import DataError
from common.segmentation import data as segmentation_data
from unet import read_trained

sys.path.append(str(REPO / "scripts" / "studies"))  # activation_memory.py, after all else

RECIPE = "recipes/unet.py"


@pytest.fixture(scope="module")
def carvana(tmp_path_factory):
    """Carvana's file types and aspect ratio, smaller: 24 JPEG images of 200x120 (WxH) with GIF
    masks named NAME_mask.gif."""
    formats = ["--image_format", "jpg", "--mask_format", "gif"]
    return make_shapes(tmp_path_factory.mktemp("carvana"), 24, "200x120", *formats)


def load(unet, root, *args):
    from common.accelerator import build_accelerator

    cfg = parse_config(
        unet.Config,
        [str(a) for a in ["--dataset", root, "--val_fraction", 0.25, "--num_workers", 0, *args]],
    )
    return unet.load_data(cfg, build_accelerator())


@pytest.mark.slow
def test_scale_keeps_the_aspect_ratio_and_predict_returns_each_mask_at_its_size(
    unet, carvana, tmp_path
):
    out = tmp_path / "out"
    res = launch(
        [RECIPE, "--dataset", carvana, "--scale", 0.5, "--output_dir", out, "--smoke", *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "20 train / 4 validation images of 100x60;" in res.output, res  # 200x120 at 0.5
    record = read_trained(out / "model.safetensors")
    assert record["input_size"] == [60, 100] and record["scale"] == 0.5
    # Predict: a Carvana image and one of another size, each scaled by 0.5 for the model, and
    # each mask written at its image's own size, in the training masks' values.
    Image.open(carvana / "imgs" / "shape_0000.jpg").save(tmp_path / "car.jpg")
    Image.open(carvana / "imgs" / "shape_0001.jpg").resize((90, 70)).save(tmp_path / "other.jpg")
    predict_here(unet, out / "model.safetensors", tmp_path / "*.jpg", tmp_path / "masks")
    for name, size in (("car", (200, 120)), ("other", (90, 70))):
        mask = Image.open(tmp_path / "masks" / f"{name}_mask.png")
        assert mask.size == size and set(np.unique(mask)) <= {0, 85, 170, 255}
    assert read_metrics(out)[-1]["eval_samples"] == 4


@pytest.mark.slow
def test_image_size_takes_height_by_width(unet, carvana):
    data = load(unet, carvana, "--image_size", "64x96")
    x, y, _ = next(iter(data.train_loader))
    assert data.input_size == (64, 96) and x.shape[2:] == y.shape[1:] == (64, 96)
    assert "validation images of 96x64;" in str(data)  # the start-up line says width x height


@pytest.mark.slow
def test_a_jpeg_made_smaller_decodes_at_reduced_size(unet, carvana, monkeypatch):
    asked = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        asked.append((mode, size))
        return draft(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    data = load(unet, carvana, "--scale", 0.5, "--cache_images", "false")
    pairs, classes = data.val_loader.dataset.pairs, data.classes
    image, _ = segmentation_data.decode_pair(pairs, 0, classes, "RGB", (60, 100))
    assert asked == [("RGB", (100, 60))] and image.shape == (3, 60, 100)
    # Close to the whole image decoded and then resized: the draft is a JPEG's own downscaling.
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, mode, size: None)
    whole, _ = segmentation_data.decode_pair(pairs, 0, classes, "RGB", (60, 100))
    assert (image.float() - whole.float()).abs().mean() < 4


def test_the_mask_scan_is_remembered_until_a_file_changes(unet, carvana, monkeypatch):
    load(unet, carvana)  # scans the masks, and decodes, keeping both results

    def no_reading(path, *args):
        raise AssertionError(f"opened {path}")

    monkeypatch.setattr(Image, "open", no_reading)
    data = load(unet, carvana)  # the same files: no file is opened
    assert data.values == [0, 85, 170, 255] and data.input_size == (120, 200)
    mask = next((carvana / "masks").glob("*.gif"))
    stat = mask.stat()
    os.utime(mask, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as an edit leaves it
    with pytest.raises(AssertionError, match="opened"):
        load(unet, carvana)


@pytest.mark.slow
def test_scaled_class_masks_are_cached_as_uint8_and_too_small_a_scale_is_named(unet, carvana):
    data = load(unet, carvana, "--scale", 0.5)
    images, masks = data.train_loader.dataset.cache
    assert images.dtype == masks.dtype == torch.uint8 and masks.shape[1:] == (60, 100)
    # Too small once scaled: the error names the scale.
    with pytest.raises(DataError, match=r"images are 40x24 at scale 0\.2, smaller than 32 pixels"):
        load(unet, carvana, "--scale", 0.2)


@pytest.mark.slow
def test_evaluation_batches_hold_a_training_batchs_pixels_unless_told(unet, carvana):
    # 60x100 once scaled, 6 validation images: by default as many a batch as training's 4 hold.
    data = load(unet, carvana, "--scale", 0.5, "--batch_size", 4)
    assert data.val_loader.batch_size == data.eval_batch_size == 4
    assert "; evaluation batches of 4 images; " in str(data)
    # Training crops 48x48: 4 of those are 9,216 pixels, one whole image 6,000.
    data = load(unet, carvana, "--scale", 0.5, "--batch_size", 4, "--crop_size", 48)
    assert data.val_loader.batch_size == 1
    data = load(unet, carvana, "--scale", 0.5, "--batch_size", 4, "--eval_batch_size", 16)
    assert data.val_loader.batch_size == 16  # as asked


@pytest.mark.slow
def test_evaluation_at_carvanas_size_needs_no_more_memory_than_training(unet):
    # The default U-Net at --scale 0.5 of Carvana (640x960 once padded), batch 4, bf16, with and
    # without grad_checkpointing: a training step's peak memory against the evaluation of the
    # batch that the default eval_batch_size forms, counted on fake tensors (nothing is
    # allocated or computed). On an H100 the old default, 16 images, took 11.5 GB against
    # training's 8.3 GB (docs/performance.md).
    from activation_memory import training_and_evaluation_peaks

    batch, height, width = 4, 640, 960
    images = segmentation_data.eval_batch_images(
        unet.Config.eval_batch_size,
        batch_size=batch,
        train_pixels=height * width,
        eval_pixels=height * width,
    )
    for checkpointing in (False, True):
        training, (evaluating,) = training_and_evaluation_peaks(
            batch=batch,
            eval_images=[images],
            height=height,
            width=width,
            grad_checkpointing=checkpointing,
        )
        assert evaluating <= training, (checkpointing, images, evaluating, training)
