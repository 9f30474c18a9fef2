"""Predict on images of any size (predict_tile) and with flips (predict_flip), with a tiny U-Net
trained at its images' own size: the recipe launched as users launch it, on generated shapes."""

import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, assert_ok, launch, make_shapes
from PIL import Image
from recipe_module import load_recipe
from unet_predict import SegmentationWeights, segment, tiled

from common.config import ConfigError, UserError, parse_config

RECIPE = "recipes/unet.py"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Peak RSS of predict on a 2048x2048 image less that on a 64x64 one, with base_channels 8: 976 MiB
# for the whole image, 72 MiB with 256-pixel tiles (docs/unet.md). The bound sits between the two.
TILED_MB = 400


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Weights trained on 64x64 shapes at their own size (bucket_by_size: input_size None), with
    vertical flips too, and the Dice of the last plain evaluation."""
    data = make_shapes(tmp_path_factory.mktemp("shapes"), 48, 64)
    out = tmp_path_factory.mktemp("native")
    # 6 epochs of 36 images: Dice about 0.8, and foreground found on the mosaic below.
    res = launch(
        [
            RECIPE,
            "--dataset",
            data,
            "--output_dir",
            out,
            "--bucket_by_size",
            "true",
            "--base_channels",
            8,
            "--lr",
            3e-3,
            "--epochs",
            6,
            "--batch_size",
            4,
            "--vflip",
            0.5,
            "--val_fraction",
            0.25,
            "--num_workers",
            0,
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    return SimpleNamespace(data=data, weights=out / "model.safetensors", dice=dice(res))


def dice(res):
    return float(re.search(r"^dice ([0-9.]+) on \d+ validation images", res.output, re.M)[1])


def predict(weights, images, out, *args):
    res = launch(
        [RECIPE, "--predict", images, "--weights", weights, "--predict_dir", out, *args],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    return res


@pytest.mark.slow
def test_tiled_and_whole_predictions_agree(native, tmp_path):
    # A 192x256 mosaic of 3 x 4 training images: shapes at the scale the model learned, so that it
    # predicts a good share of foreground, which the tiles must place where the whole image does.
    images = [
        np.asarray(Image.open(native.data / "imgs" / f"shape_{i:04d}.png")) for i in range(12)
    ]
    (tmp_path / "in").mkdir()
    rows = [np.concatenate(images[r * 4 : r * 4 + 4], 1) for r in range(3)]
    Image.fromarray(np.concatenate(rows)).save(tmp_path / "in" / "mosaic.png")
    predict(native.weights, tmp_path / "in" / "mosaic.png", tmp_path / "whole")
    predict(
        native.weights, tmp_path / "in" / "mosaic.png", tmp_path / "tiled", "--predict_tile", 64
    )
    whole, tiles = (
        np.asarray(Image.open(tmp_path / kind / "mosaic_mask.png")) for kind in ("whole", "tiled")
    )
    assert whole.shape == tiles.shape == (192, 256)
    assert (whole > 0).mean() > 0.05, (whole > 0).mean()
    assert (whole == tiles).mean() >= 0.995, (whole == tiles).mean()


def test_tiles_blend_to_the_whole_image_for_a_pixelwise_model():
    # A 1x1 convolution sees no context, so the blended tiles must give its logits exactly:
    # every pixel's weights sum to what they are divided by, wherever the tiles overlap.
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 4, 1)
    x = torch.rand(2, 3, 208, 144)
    with torch.inference_mode():
        torch.testing.assert_close(tiled(net, x, 64), net(x))
        assert tiled(net, x, 0) is not None and tiled(net, x, 256).shape == (2, 4, 208, 144)


@pytest.mark.slow
def test_a_large_image_predicts_in_tiles_in_bounded_memory(native, tmp_path):
    """Peak RSS of predict on a 2048x2048 image with 256-pixel tiles, less that on a 64x64 one."""
    big = make_shapes(tmp_path / "big", 1, 2048)
    peaks = {}
    for name, image in (
        ("small", native.data / "imgs" / "shape_0000.png"),
        ("big", big / "imgs" / "shape_0000.png"),
    ):
        # The peak of the recipe's process alone, from a fresh parent that launches nothing else.
        code = (
            "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
        )
        res = launch(
            [
                "-c",
                code,
                sys.executable,
                REPO / RECIPE,
                "--predict",
                image,
                "--weights",
                native.weights,
                "--predict_dir",
                tmp_path / name,
                "--predict_tile",
                256,
            ],
            launcher="python",
            env=ONE_THREAD,
        )
        assert_ok(res)
        peaks[name] = int(re.search(r"peak_kib (\d+)", res.output)[1]) / 1024
    assert Image.open(tmp_path / "big" / "shape_0000_mask.png").size == (2048, 2048)
    assert peaks["big"] - peaks["small"] < TILED_MB, peaks


@pytest.mark.slow
def test_predict_flip_averages_over_the_flips_of_training(native, tmp_path):
    assert SegmentationWeights.read(native.weights).flips == "hv"  # trained with hflip and vflip
    res = launch(
        [
            RECIPE,
            "--eval_only",
            "true",
            "--weights",
            native.weights,
            "--dataset",
            native.data,
            "--val_fraction",
            0.25,
            "--bucket_by_size",
            "true",
            "--base_channels",
            8,
            "--num_workers",
            0,
            "--output_dir",
            tmp_path / "eval",
            "--predict_flip",
            "true",
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert dice(res) != native.dice  # the same weights and images, the mean of 4 flipped views


def test_bad_settings_are_rejected():
    config = load_recipe("unet").Config
    for args, message in [
        (["--predict_tile", "40"], "predict_tile must be 0 or a multiple of 16 from 32 up"),
        (["--predict_tile", "16"], "predict_tile must be 0 or a multiple of 16 from 32 up"),
        (
            ["--hflip", "0", "--predict_flip", "true"],
            "predict_flip averages over the flips of training",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(config, args)


def test_flipped_views_are_averaged_as_logits():
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 2, 3, padding=1)  # not flip-equivariant
    x = torch.rand(1, 3, 32, 48)
    cfg = SimpleNamespace(predict_tile=0, predict_flip=True)
    with torch.inference_mode():
        views = [
            net(x),
            net(x.flip(3)).flip(3),
            net(x.flip(2)).flip(2),
            net(x.flip(2, 3)).flip(2, 3),
        ]
        torch.testing.assert_close(segment(net, x, cfg, "hv"), sum(views) / 4)
        torch.testing.assert_close(segment(net, x, cfg, "h"), (views[0] + views[1]) / 2)
        plain = SimpleNamespace(predict_tile=0, predict_flip=False)
        assert torch.equal(segment(net, x, plain, "hv"), net(x))
        # As eval_only and predict say it.
        with pytest.raises(UserError, match="this model was trained with none"):
            segment(net, x, cfg, "")
