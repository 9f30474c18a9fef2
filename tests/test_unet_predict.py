"""Predict with the U-Net recipe, launched as users launch it, on generated shapes: masks at each
image's own size in the mask values, one line that says why where weights do not fit, and images
of any size (predict_tile) and with flips (predict_flip) from a tiny U-Net trained at its images'
own size."""

import gc
import json
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import (
    ONE_THREAD,
    REPO,
    SIZE,
    VALUES,
    assert_ok,
    launch,
    make_shapes,
    predict_here,
)
from PIL import Image
from recipe_module import load_recipe

import unet_rules
from common.config import ConfigError, UserError, parse_config
from common.runtime import run_serving
from common.segmentation.inference import segment, tiled
from unet import read_trained

RECIPE = "recipes/unet.py"


# ---- Masks from the weights of the shared run (trained_unet) ----


@pytest.mark.slow
def test_the_training_file_predicts_with_the_serving_files_own_settings(
    trained_unet, shapes, tmp_path
):
    # predict_dir and overlay are unet_predict.py's settings, not unet.py's: the training file
    # given --predict hands the command line over before it reads it.
    out, _ = trained_unet
    image = sorted((shapes / "imgs").glob("*.png"))[0]
    args = [RECIPE, "--predict", image, "--weights", out / "model.safetensors", "--overlay"]
    res = launch([*args, "--predict_dir", tmp_path / "p"], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        f"{image.stem}_mask.png",
        f"{image.stem}_overlay.png",
    ]
    assert "overlay" not in launch([RECIPE, "--help"], launcher="python").output


@pytest.mark.slow
def test_predictions_go_beside_the_weights(trained_unet, shapes, unet, tmp_path):
    # Two models predict into their own folders, not both into output_dir/predictions.
    from common.accelerator import build_accelerator

    out, _ = trained_unet
    folder = tmp_path / "model-a"
    folder.mkdir()
    shutil.copy(out / "model.safetensors", folder)
    image = sorted((shapes / "imgs").glob("*.png"))[0]
    args = ["--predict", str(image), "--weights", str(folder / "model.safetensors")]
    serving = load_recipe("unet_predict")
    serving.predict(parse_config(serving.ServingConfig, args), build_accelerator())
    assert [p.name for p in (folder / "predictions").iterdir()] == [f"{image.stem}_mask.png"]


@pytest.mark.slow
def test_predict_writes_masks_at_the_original_size_in_mask_values(trained_unet, shapes, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    Image.open(shapes / "imgs" / "shape_0001.png").resize((61, 37)).save(inputs / "a.png")
    grey = Image.open(shapes / "imgs" / "shape_0002.png").resize((100, 80)).convert("L")
    grey.save(inputs / "b.png")
    Image.open(shapes / "imgs" / "shape_0003.png").save(inputs / "c.jpg")
    shutil.copy(shapes / "imgs" / "shape_0000.png", inputs / "d.png")
    sizes = {"a": (61, 37), "b": (100, 80), "c": (SIZE, SIZE), "d": (SIZE, SIZE)}
    res = launch(
        [
            RECIPE,
            "--predict",
            f"{inputs}/*",
            "--weights",
            trained_unet[0] / "model.safetensors",
            "--predict_dir",
            tmp_path / "out",
            "--overlay",
            "--eval_batch_size",
            3,
        ],
        nproc=2,
    )
    assert_ok(res)
    assert "wrote 4 masks" in res.output
    for name, size in sizes.items():
        mask = Image.open(tmp_path / "out" / f"{name}_mask.png")
        assert mask.size == size and mask.mode == "L"
        assert set(np.unique(np.asarray(mask)).tolist()) <= VALUES
        assert Image.open(tmp_path / "out" / f"{name}_overlay.png").size == size
    # On an image from the data, the mask must be close to the true one, in the same values.
    pred = np.asarray(Image.open(tmp_path / "out" / "d_mask.png"))
    true = np.asarray(Image.open(shapes / "masks" / "shape_0000_mask.png"))
    assert (pred == true).mean() > 0.9 and (pred[true > 0] > 0).mean() > 0.5


@pytest.mark.slow
def test_weights_of_an_older_recipe_version_say_to_train_again(
    trained_unet, unet, shapes, tmp_path
):
    # Weights files written before the settings became one JSON entry (one key each), or before
    # the record held in_channels: one line that says to train again, not a traceback or a
    # wrong model (the one line of a user error: test_config.py's launch).
    from safetensors.torch import load_file, save_file

    weights = trained_unet[0] / "model.safetensors"
    old = tmp_path / "old.safetensors"
    one_key_each = {"recipe": "unet", "mask_values": "0,85,170,255", "num_classes": "4"}
    save_file(load_file(weights), old, metadata=one_key_each)
    message = (
        f"{old} holds no settings of this recipe: predict and export need a model.safetensors "
        f"that its training wrote (train again if an older version wrote it)"
    )
    with pytest.raises(UserError, match=re.escape(message)):  # what predict and export meet
        predict_here(unet, old, shapes / "imgs" / "shape_0000.png", tmp_path / "masks")
    record = read_trained(weights)
    del record["model"]["in_channels"]
    save_file(load_file(weights), old, {"segmentation": json.dumps(record)})
    message = f"{old} records no in_channels: an older version of this recipe wrote it; train "
    with pytest.raises(UserError, match=re.escape(message)):
        unet.read_trained(old)


@pytest.mark.slow
def test_weights_that_do_not_fit_say_why_in_one_short_line(trained_unet, unet, tmp_path):
    # What main() calls with --weights, before and after the data.
    from safetensors.torch import save_file

    from common.checkpoint import fit_to_record, load_weights
    from common.config import UserError

    weights = trained_unet[0] / "model.safetensors"
    cfg = unet.Config(weights=str(weights))  # base_channels 64, the default
    with pytest.raises(UserError) as e:
        model_settings = read_trained(weights)["model"]
        fit_to_record(
            cfg, model_settings, unet.MODEL_SETTINGS, path=weights, inferred=unet.INFERRED
        )
    assert (
        str(e.value)
        == f"{weights} was trained with base_channels 16, not 64: add --base_channels 16"
    )
    # Another recipe's weights: no settings stored, and none of the tensors fit.
    save_file({"fc.weight": torch.zeros(10, 784)}, tmp_path / "other.safetensors")
    assert read_trained(tmp_path / "other.safetensors") is None
    model = unet.build_model(
        {
            **{name: getattr(cfg, name) for name in unet.MODEL_SETTINGS},
            "in_channels": 3,
            "num_classes": 4,
        }
    )
    with pytest.raises(UserError) as e:
        load_weights(model, tmp_path / "other.safetensors")
    assert "118 of the model's 118 tensors are missing, such as " in str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


# ---- Tiles and flips ----


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
    return float(re.search(r"^dice ([0-9.]+), miou [0-9.]+ on \d+ validation", res.output, re.M)[1])


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
    unet = load_recipe("unet")
    predict_here(unet, native.weights, tmp_path / "in" / "mosaic.png", tmp_path / "whole")
    mosaic = tmp_path / "in" / "mosaic.png"
    predict_here(unet, native.weights, mosaic, tmp_path / "tiled", "--predict_tile", 64)
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
    assert read_trained(native.weights)["flips"] == "hv"  # trained with hflip and vflip
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


def test_flipped_views_are_averaged_as_logits(unet):
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 2, 3, padding=1)  # not flip-equivariant
    x = torch.rand(1, 3, 32, 48)
    with torch.inference_mode():
        views = [
            net(x),
            net(x.flip(3)).flip(3),
            net(x.flip(2)).flip(2),
            net(x.flip(2, 3)).flip(2, 3),
        ]
        torch.testing.assert_close(segment(net, x, flips="hv"), sum(views) / 4)
        torch.testing.assert_close(segment(net, x, flips="h"), (views[0] + views[1]) / 2)
        assert torch.equal(segment(net, x, flips=""), net(x))
    # The recipe averages over the flips of training with predict_flip, else over none.
    cfg = SimpleNamespace(predict_flip=True)
    assert unet_rules.flips_to_average(cfg, "hv") == "hv"
    assert unet_rules.flips_to_average(SimpleNamespace(predict_flip=False), "hv") == ""
    with pytest.raises(UserError, match="this model was trained with none"):  # eval_only, predict
        unet_rules.flips_to_average(cfg, "")


@pytest.mark.slow
def test_the_serving_file_runs_on_its_own_as_the_recipe_runs_it(
    trained_unet, shapes, tmp_path, monkeypatch, capsys
):
    # python recipes/unet_predict.py --weights W "photos/*.jpg", as milesial's predict.py runs:
    # the same masks as the recipe's --predict (predict_here), and one line for a run that
    # would train.
    weights = trained_unet[0] / "model.safetensors"
    pattern = shapes / "imgs" / "shape_000[0-2].png"
    res = launch(
        ["recipes/unet_predict.py", "--weights", weights, pattern, "--predict_dir", tmp_path / "a"],
        launcher="python",
    )
    assert_ok(res)
    assert "wrote 3 masks" in res.output, res
    predict_here(load_recipe("unet"), weights, pattern, tmp_path / "b")
    for name in ("shape_0000", "shape_0001", "shape_0002"):
        mask = f"{name}_mask.png"
        assert (tmp_path / "a" / mask).read_bytes() == (tmp_path / "b" / mask).read_bytes()
    # As its __main__ runs it: a run that would train is one line, exit status 2.
    serving = load_recipe("unet_predict")
    monkeypatch.setattr(sys, "argv", ["recipes/unet_predict.py", "--epochs", "2"])
    try:
        with pytest.raises(SystemExit) as stopped:
            run_serving(
                serving.serve, serving.ServingConfig, recipe="unet", script=serving.__file__
            )
    finally:
        gc.unfreeze()  # run() froze what this process had made, as a process's end does
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: unet_predict.py predicts (a glob of files), exports (--export onnx) or checks the "
        "data (--check_data); train with unet.py\n"
    )
