"""The U-Net recipe, launched as users launch it, on a tiny shapes dataset made by
scripts/make_shapes.py."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import unet_data
import yaml
from conftest import REPO, assert_ok, compile_config, launch, read_metrics
from PIL import Image
from recipe_module import load_recipe
from safetensors import safe_open
from unet_data import IGNORE, open_sources
from unet_predict import SegmentationWeights

from common.config import ConfigError, parse_config
from common.data import DataError, crop_and_flip
from common.schedule import fit_cosine

RECIPE = "recipes/unet.py"
N_IMAGES, SIZE, VAL_FRACTION = 73, 48, 0.2
# int(73 * 0.2): not a multiple of 2 processes x eval_batch_size 4, so the last batch is padded.
N_VAL = 14
N_TRAIN = N_IMAGES - N_VAL
VALUES = {0, 85, 170, 255}  # make_shapes.py: background, circle, rectangle, triangle
# Small and quick on a CPU, and wide enough (16) that every seed tried learns every class in 10
# epochs. One thread: on 2 cores a second one slows convolutions this small down several times.
LR = 3e-3
FAST = [
    "--base_channels",
    16,
    "--lr",
    LR,
    "--val_fraction",
    VAL_FRACTION,
    "--num_workers",
    0,
    "--eval_batch_size",
    4,
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "make_shapes.py",
            "--out",
            root,
            "--count",
            str(N_IMAGES),
            "--size",
            str(SIZE),
        ],
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="module")
def trained(shapes, tmp_path_factory):
    """One single-process `python recipes/unet.py` run; later tests use its weights."""
    out = tmp_path_factory.mktemp("unet_1p")
    res = launch(
        [RECIPE, "--dataset", shapes, "--output_dir", out, "--epochs", 10, *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    return out, res


def all_background_dice(mask_dir):
    """The Dice of predicting background everywhere: the share of absent foreground classes."""
    masks = [set(np.unique(np.asarray(Image.open(p))).tolist()) for p in mask_dir.glob("*.png")]
    return float(np.mean([len(VALUES - m) / 3 for m in masks]))


@pytest.mark.slow
def test_single_process_learns_and_writes_the_output_contract(trained, shapes):
    out, res = trained
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == list(range(1, 11))
    assert {
        "epoch",
        "step",
        "world_size",
        "lr",
        "train_loss",
        "train_samples_per_s",
        "dice",
        "eval_loss",
        "eval_samples",
    } <= rows[-1].keys()
    assert rows[-1]["world_size"] == 1 and rows[-1]["eval_samples"] == N_VAL
    assert rows[-1]["step"] == 10 * math.ceil(N_TRAIN / 8)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all_background_dice(shapes / "masks") < 0.6  # the best a model that learned nothing does
    assert rows[-1]["dice"] > 0.85, rows  # 0.94 to 0.98 with seeds 0 to 5
    assert yaml.safe_load((out / "config.yaml").read_text())["base_channels"] == 16
    # num_classes was left at 0: one class per mask value found. The weights file stores it, typed.
    stored = SegmentationWeights.read(out / "model.safetensors")
    assert stored.model == {
        "in_channels": 3,
        "num_classes": 4,
        "base_channels": 16,
        "bilinear": False,
    }
    assert stored.mask_values == [0, 85, 170, 255] and stored.input_size == [SIZE, SIZE]
    assert yaml.safe_load((out / "config.yaml").read_text())["num_classes"] == 4
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert "outc.weight" in keys and not any(k.startswith("module.") for k in keys)
    assert "classes: mask values 0,85,170,255" in res.output and f"outputs in {out}/" in res.output
    assert f"; fused AdamW lr {LR:g};" in res.output  # a CPU has the fused kernels (make_optimizer)
    # channels_last auto is off on a CPU; these images fit the cache (cache_images auto).
    assert (
        "; channels_last off (auto); images decoded once, 1 MB in cpu memory; 59 train"
        in res.output
    )
    config = yaml.safe_load((out / "config.yaml").read_text())  # as resolved, not "auto"
    assert (config["channels_last"], config["cache_images"]) == (False, True)


@pytest.mark.slow
def test_two_processes_exact_eval_count_lr_schedule_and_tensorboard_panels(shapes, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = launch(
        [
            RECIPE,
            "--dataset",
            shapes,
            "--output_dir",
            tmp_path,
            "--epochs",
            2,
            "--batch_size",
            4,
            "--channels_last",
            "true",
            *FAST,
            "--log_with",
            "tensorboard",
            "--log_every",
            2,
        ],
        nproc=2,
    )
    assert_ok(res)
    assert "2 process(es) on cpu, gloo" in res.output and "; channels_last on; " in res.output
    # PyTorch's SyncBatchNorm has no CPU kernels; the start-up line says what each run uses.
    assert "BatchNorm per process (SyncBatchNorm needs GPUs)" in res.output
    rows = read_metrics(tmp_path)
    steps = math.ceil(math.ceil(N_TRAIN / 4) / 2)  # batches of 4, shared by 2 processes
    assert [r["eval_samples"] for r in rows] == [N_VAL, N_VAL]
    assert [r["step"] for r in rows] == [steps, 2 * steps] and rows[0]["world_size"] == 2
    # Cosine over 2 epochs: half way, half the lr. A scheduler stepped once per process: at 0.
    assert rows[1]["lr"] == pytest.approx(LR * 0.5 * (1 + math.cos(math.pi * steps / (2 * steps))))
    # TensorBoard: scalars and image panels at the evaluations' steps, from the main process alone.
    (events,) = (tmp_path / "unet").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"images": 10})
    acc.Reload()
    assert {"train/loss", "eval/dice"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("eval/dice")] == [r["step"] for r in rows]
    images = acc.Images("eval/image_prediction_truth")
    assert [e.step for e in images] == [r["step"] for r in rows]
    assert images[0].width == 4 * 3 * images[0].height  # 4 of image | prediction | truth, in a row


@pytest.mark.slow
def test_the_cosine_schedule_refits_when_a_resume_changes_the_process_count(shapes, tmp_path):
    args = [
        RECIPE,
        "--dataset",
        shapes,
        "--output_dir",
        tmp_path,
        *FAST,
        "--base_channels",
        8,
        "--batch_size",
        8,
        "--epochs",
        2,
    ]
    per_epoch = math.ceil(N_TRAIN / 8)  # optimizer steps per epoch on 1 process; half as many on 2
    half = per_epoch // 2
    assert_ok(launch([*args, "--max_steps", half], nproc=2))  # the end of epoch 1 on 2 processes

    def schedule(step):
        state = tmp_path / "checkpoints" / f"step-{step:08d}" / "trainer_state.json"
        return json.loads(state.read_text())["scheduler"]

    # max_steps stops the run but does not shorten the schedule: half way through it, half the lr.
    assert schedule(half)["T_max"] == 2 * half
    assert schedule(half)["_last_lr"][0] == pytest.approx(LR / 2)
    # Epoch 2 on 1 process: the cosine now ends half + per_epoch steps in (not 2 * half, where a
    # schedule restored as saved would stop), and the lr moves onto that curve.
    res = launch([*args, "--resume", "latest"], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    assert f"(epoch 2, step {half})" in res.output
    last = half + per_epoch
    lr = read_metrics(tmp_path)[-1]["lr"]
    assert lr == pytest.approx(LR * (1 + math.cos(math.pi * half / last)) / 2)
    assert schedule(last)["T_max"] == last
    assert schedule(last)["_last_lr"][0] == pytest.approx(0, abs=1e-12)


def test_a_resume_with_the_same_plan_leaves_the_cosine_alone_after_skipped_fp16_steps(unet):
    # fp16's gradient scaler skips a few steps, and the recipe does not step the schedule on
    # those: its count then trails the optimizer steps. Resuming with the same epochs must
    # still continue the saved curve, not refit it.
    cfg = unet.Config(epochs=2)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)
    fit_cosine(scheduler, cfg, SimpleNamespace(epoch=1, batches_done=0, step=0), steps_per_epoch=10)
    assert scheduler.T_max == 20 and optimizer.param_groups[0]["lr"] == 1.0
    for step in range(1, 11):
        optimizer.step()
        if step > 2:  # steps 1 and 2 were skipped
            scheduler.step()
    saved, lr = scheduler.state_dict(), optimizer.param_groups[0]["lr"]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)
    scheduler.load_state_dict(saved)
    fit_cosine(
        scheduler, cfg, SimpleNamespace(epoch=2, batches_done=0, step=10), steps_per_epoch=10
    )
    assert scheduler.T_max == 20 and optimizer.param_groups[0]["lr"] == lr
    # Three epochs instead of two: the curve now ends 20 steps on, where its count will be.
    fit_cosine(
        scheduler,
        unet.Config(epochs=3),
        SimpleNamespace(epoch=2, batches_done=0, step=10),
        steps_per_epoch=10,
    )
    assert scheduler.T_max == 8 + 20
    assert optimizer.param_groups[0]["lr"] == pytest.approx((1 + math.cos(math.pi * 8 / 28)) / 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm runs on GPUs only")
def test_two_gpus_use_syncbatchnorm(shapes, tmp_path):
    res = launch([RECIPE, "--dataset", shapes, "--output_dir", tmp_path, "--smoke", *FAST], nproc=2)
    assert_ok(res)
    assert "; SyncBatchNorm;" in res.output


@pytest.mark.slow
def test_eval_is_the_same_on_one_and_two_processes(trained, shapes, tmp_path):
    weights = trained[0] / "model.safetensors"
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"eval{nproc}"
        res = launch(
            [
                RECIPE,
                "--dataset",
                shapes,
                "--output_dir",
                out,
                "--eval_only",
                "--weights",
                weights,
                *FAST,
            ],
            nproc=nproc,
            env=ONE_THREAD,
        )
        assert_ok(res)
        (results[nproc],) = read_metrics(out)
    assert results[1]["eval_samples"] == results[2]["eval_samples"] == N_VAL
    assert results[1]["dice"] == pytest.approx(read_metrics(trained[0])[-1]["dice"], abs=1e-6)
    # The batches differ, not the images.
    assert results[2]["dice"] == pytest.approx(results[1]["dice"], abs=1e-3)


@pytest.mark.slow
def test_predict_writes_masks_at_the_original_size_in_mask_values(trained, shapes, tmp_path):
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
            trained[0] / "model.safetensors",
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


@pytest.fixture(scope="module")
def unet():
    """The recipe as a module, for its Config and data functions."""
    return load_recipe("unet")


def copy_with_a_bad_mask(shapes, unet, root, change):
    """A copy of the data where change() alters the mask that the second process reads first."""
    shutil.copytree(shapes, root)
    train, val = open_sources(unet.Config(dataset=str(root), val_fraction=VAL_FRACTION))
    bad = (train + val)[1][1]  # scan_masks gives rank r the pairs r, r + 2, ...
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
        f"0,85,170,255: fix the mask, or list the value in --mask_values"
    ], res


@pytest.mark.slow
def test_a_mask_that_does_not_fit_its_image_is_named(shapes, unet, tmp_path):
    # What the scan says; the launch above shows that what rank 1 finds reaches the user once.
    from unet_data import scan_masks

    from common.accelerator import build_accelerator

    bad = copy_with_a_bad_mask(
        shapes, unet, tmp_path / "data", lambda m: m.resize((SIZE, SIZE - 1))
    )
    message = f"mask {bad} is {SIZE}x{SIZE - 1}, its image {SIZE}x{SIZE}"
    with pytest.raises(DataError, match=re.escape(message)):
        scan_masks(
            build_accelerator(),
            open_sources(unet.Config(dataset=str(tmp_path / "data"), val_fraction=VAL_FRACTION)),
        )


def data_error(unet, **settings):
    """The one-line DataError that the recipe's load_data() stops with: a launch would print it
    as `error: ...` (test_a_mask_value_outside_mask_values_stops_every_rank_with_one_line)."""
    from unet_data import load_data

    from common.accelerator import build_accelerator

    cfg = unet.Config(val_fraction=VAL_FRACTION, **settings)
    with pytest.raises(DataError) as e:
        load_data(cfg, build_accelerator(), unet.input_channels)
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
def test_weights_saved_with_one_key_per_setting_say_to_train_again(trained, shapes, tmp_path):
    # The metadata of weights files written before the settings became one JSON entry, which
    # predict no longer reads: one line that says so, not a traceback or a wrong model.
    from safetensors.torch import load_file, save_file

    old = tmp_path / "old.safetensors"
    save_file(
        load_file(trained[0] / "model.safetensors"),
        old,
        metadata={
            "recipe": "unet",
            "mask_values": "0,85,170,255",
            "num_classes": "4",
            "base_channels": "16",
            "bilinear": "False",
            "input_size": f"{SIZE},{SIZE}",
        },
    )
    res = launch(
        [
            RECIPE,
            "--predict",
            shapes / "imgs" / "shape_0000.png",
            "--weights",
            old,
            "--predict_dir",
            tmp_path,
        ],
        launcher="python",
    )
    assert res.returncode == 2 and res.output.strip().splitlines() == [
        f"error: {old} stores its settings one key each, an old format that this recipe no "
        f"longer reads: train the model again to save it anew"
    ], res


def recoloured(shapes, root, mode, count=None):
    """A copy of the shapes (the first `count` pairs) with the images in PIL `mode`."""
    for folder in ("imgs", "masks"):
        (root / folder).mkdir(parents=True)
        for path in sorted((shapes / folder).glob("*.png"))[:count]:
            image = Image.open(path)
            (image.convert(mode) if folder == "imgs" else image).save(root / folder / path.name)
    return root


@pytest.mark.slow
def test_grey_and_rgba_images_train_in_their_own_channels_and_predict_converts(
    unet, shapes, tmp_path
):
    grey = recoloured(shapes, tmp_path / "grey", "L")
    res = launch(
        [RECIPE, "--dataset", grey, "--output_dir", tmp_path / "out", "--smoke", *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "; L images; " in res.output, res
    weights = tmp_path / "out" / "model.safetensors"
    assert SegmentationWeights.read(weights).model["in_channels"] == 1
    # Predict reads any image in the channels the weights were trained on.
    inputs = tmp_path / "in"
    inputs.mkdir()
    Image.open(shapes / "imgs" / "shape_0000.png").save(inputs / "rgb.png")
    Image.open(shapes / "imgs" / "shape_0001.png").convert("RGBA").save(inputs / "rgba.png")
    assert_ok(
        launch(
            [
                RECIPE,
                "--predict",
                f"{inputs}/*",
                "--weights",
                weights,
                "--predict_dir",
                tmp_path / "masks",
                "--overlay",
            ],
            launcher="python",
            env=ONE_THREAD,
        )
    )
    masks = {p.name for p in (tmp_path / "masks").glob("*_mask.png")}
    assert masks == {"rgb_mask.png", "rgba_mask.png"}
    # eval_only of these weights on RGB images: the model and the images take the stored 1 channel.
    res = launch(
        [
            RECIPE,
            "--dataset",
            shapes,
            "--output_dir",
            tmp_path / "eval",
            "--eval_only",
            "--weights",
            weights,
            *FAST,
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "; L images; " in res.output, res
    assert read_metrics(tmp_path / "eval")[0]["eval_samples"] == N_VAL
    # RGBA images: 4 channels, read as such by the loaders.
    from unet_data import load_data

    from common.accelerator import build_accelerator

    cfg = unet.Config(
        dataset=str(recoloured(shapes, tmp_path / "rgba", "RGBA", 20)),
        val_fraction=0.2,
        cache_images=False,
        num_workers=0,
    )
    data = load_data(cfg, build_accelerator(), unet.input_channels)
    x, _ = next(iter(data.train_loader))
    assert data.in_channels == 4 and x.shape[1] == 4 and x.dtype == torch.uint8


def test_images_of_different_channels_say_which_and_what_to_set(unet, shapes, tmp_path):
    from unet_data import load_data

    from common.accelerator import build_accelerator

    root = recoloured(shapes, tmp_path / "data", "RGB", 20)
    grey = root / "imgs" / "shape_0007.png"
    Image.open(grey).convert("L").save(grey)
    cfg = unet.Config(dataset=str(root), val_fraction=0.2, num_workers=0)
    message = (
        re.escape(f"images have different channels: {grey} is L (1), ")
        + r"\S+ is RGB \(3\): convert them to one mode, or set --in_channels 3 to read all "
        r"as RGB$"
    )
    with pytest.raises(DataError, match=message):
        load_data(cfg, build_accelerator(), unet.input_channels)
    # Set, in_channels reads them all alike.
    data = load_data(replace(cfg, in_channels=3), build_accelerator(), unet.input_channels)
    assert data.in_channels == 3 and next(iter(data.val_loader))[0].shape[1] == 3


@pytest.mark.slow
def test_weights_written_before_in_channels_was_stored_take_rgb(trained, shapes, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = trained[0] / "model.safetensors"
    stored = json.loads(SegmentationWeights.read(weights).metadata()["segmentation"])
    del stored["model"]["in_channels"]
    old = tmp_path / "old.safetensors"
    save_file(load_file(weights), old, {"segmentation": json.dumps(stored)})
    assert SegmentationWeights.read(old).in_channels == 3
    Image.open(shapes / "imgs" / "shape_0000.png").convert("L").save(tmp_path / "grey.png")
    res = launch(
        [RECIPE, "--predict", tmp_path / "grey.png", "--weights", old, "--predict_dir", tmp_path],
        launcher="python",
    )
    assert_ok(res)
    assert Image.open(tmp_path / "grey_mask.png").size == (SIZE, SIZE)


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
    res = launch(
        [
            RECIPE,
            "--predict",
            images[60],
            "--weights",
            out / "model.safetensors",
            "--predict_dir",
            out,
        ],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    mask = Image.open(out / f"{images[60].stem}_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= {0, 255}


@pytest.mark.slow
def test_weights_that_do_not_fit_say_why_in_one_short_line(trained, unet, tmp_path):
    # What main() calls with --weights, before and after the data; the launch of
    # test_weights_saved_with_one_key_per_setting_say_to_train_again shows such a line printed.
    from safetensors.torch import save_file
    from unet_predict import fit_to_weights

    from common.checkpoint import load_weights
    from common.config import UserError

    weights = trained[0] / "model.safetensors"
    cfg = unet.Config(weights=str(weights))  # base_channels 64, the default
    with pytest.raises(UserError) as e:
        fit_to_weights(cfg, SegmentationWeights.read(weights), unet.MODEL_SETTINGS)
    assert (
        str(e.value)
        == f"{weights} was trained with base_channels 16, not 64: add --base_channels 16"
    )
    # Another recipe's weights: no settings stored, and none of the tensors fit.
    save_file({"fc.weight": torch.zeros(10, 784)}, tmp_path / "other.safetensors")
    assert SegmentationWeights.read(tmp_path / "other.safetensors") is None
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


def test_bad_settings_are_rejected(unet):
    for args, message in [
        (["--mask_values", "0,x"], "mask_values must be distinct non-negative integers"),
        (
            ["--num_classes", "4", "--mask_values", "0,255"],
            "mask_values needs one value per class (4 for num_classes 4)",
        ),
        (["--num_classes", "1", "--mask_values", "0,1,2"], "(2 for num_classes 1)"),
        (["--crop_size", "64", "--image_size", "48"], "crop_size cannot exceed image_size"),
        (["--image_size", "20"], "image_size must be 0 or at least 32"),
        (["--scheduler", "step"], "scheduler must be cosine or plateau"),
        (["--predict", "x.png"], "predict needs weights"),
        (
            ["--bucket_by_size", "true", "--image_size", "64"],
            "bucket_by_size trains on the images' own sizes",
        ),
        (
            ["--channels_last", "maybe"],
            "--channels_last must be a bool (true/false) or auto, got 'maybe'",
        ),
        (["--cache_images", "2"], "--cache_images must be a bool (true/false) or auto, got '2'"),
        (["--num_workers", "-2"], "num_workers must be at least -1, got -2"),
        (["--in_channels", "5"], "in_channels must be 0 (from the images), 1, 2, 3 or 4, got 5"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(unet.Config, args)


def test_missing_default_data_says_how_to_make_it(unet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = "data/shapes does not exist yet: write it with `make data/shapes`"
    with pytest.raises(DataError, match=re.escape(message)):
        open_sources(unet.Config())


def assert_resume_is_bit_identical(args, out, stop_at, steps, nproc=1):
    """Training `steps` steps straight and resuming from its checkpoint at step `stop_at` (a
    mid-epoch one, written as a stop writes it) to `steps` give the same weights."""
    from safetensors.torch import load_file

    assert_ok(
        launch(
            [
                *args,
                "--output_dir",
                out / "straight",
                "--max_steps",
                steps,
                "--checkpoint_every_steps",
                stop_at,
                "--keep_checkpoints",
                10,
            ],
            nproc=nproc,
            env=ONE_THREAD,
        )
    )
    name = f"step-{stop_at:08d}"
    shutil.copytree(out / "straight" / "checkpoints" / name, out / "split" / "checkpoints" / name)
    res = launch(
        [*args, "--output_dir", out / "split", "--max_steps", steps, "--resume", "latest"],
        nproc=nproc,
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert f"(epoch 1, step {stop_at})" in res.output
    a, b = (load_file(out / d / "model.safetensors") for d in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cache, nproc, stop_at, steps", [("false", 1, 5, 12), ("true", 2, 3, 8)])
def test_stop_and_resume_is_bit_identical_with_crops_and_flips(
    shapes, tmp_path, cache, nproc, stop_at, steps
):
    # Augmentation is seeded per (seed, epoch, sample), so with 2 (persistent) workers decoding,
    # or from the cache, on 1 process or 2, a resumed run sees the same crops and flips as an
    # uninterrupted one, across an epoch end (8 steps an epoch on 1 process, 4 on 2).
    args = [
        RECIPE,
        "--dataset",
        shapes,
        *FAST,
        "--num_workers",
        2,
        "--base_channels",
        8,
        "--epochs",
        2,
        "--batch_size",
        8,
        "--crop_size",
        32,
        "--vflip",
        0.5,
        "--cache_images",
        cache,
    ]
    assert_resume_is_bit_identical(args, tmp_path, stop_at=stop_at, steps=steps, nproc=nproc)
    # config.yaml records the settings as the run resolved them: channels_last auto is off on CPUs.
    config = yaml.safe_load((tmp_path / "straight" / "config.yaml").read_text())
    assert (config["channels_last"], config["cache_images"]) == (False, cache == "true")


def epoch_batches(unet, cfg, epoch):
    """The training batches of an epoch, from the recipe's loader as its main() builds it."""
    from functools import partial

    from unet_data import load_data

    from common.accelerator import build_accelerator

    data = load_data(cfg, build_accelerator(), unet.input_channels, partial(unet.augment, cfg=cfg))
    # The order: the loader's first, from its own seeded generator.
    data.train_loader.dataset.epoch = epoch
    return data.reading, list(data.train_loader)


@pytest.mark.slow
def test_cached_and_decoded_batches_are_identical_with_any_number_of_workers(unet, shapes):
    settings = dict(
        dataset=str(shapes), val_fraction=VAL_FRACTION, batch_size=8, crop_size=40, vflip=0.5
    )
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


# bucket_by_size: images of different sizes, each trained and evaluated at its own size.
N_MIXED, MIXED_SIZES = 40, "40,64,96"  # make_shapes.py --sizes: each height and width is one
N_MIXED_VAL = int(N_MIXED * VAL_FRACTION)


@pytest.fixture(scope="session")
def mixed_shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed_shapes")
    subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "make_shapes.py",
            "--out",
            root,
            "--count",
            str(N_MIXED),
            "--sizes",
            MIXED_SIZES,
        ],
        check=True,
        capture_output=True,
    )
    return root


@pytest.mark.slow
def test_bucketed_eval_and_saving_leave_a_compiled_ddp_model_whole(mixed_shapes, tmp_path):
    res = launch(
        ["tests/compile_probe.py", mixed_shapes, tmp_path, VAL_FRACTION],
        nproc=2,
        config=compile_config(tmp_path),
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert res.output.count("compiled DDP model whole") == 2, res
    # Both ranks report the reduced count: every validation image exactly once.
    assert re.findall(r"whole; (\d+) images evaluated", res.output) == [str(N_MIXED_VAL)] * 2, res


@pytest.mark.slow
def test_without_bucket_by_size_mixed_sizes_say_what_to_set(mixed_shapes, unet):
    error = data_error(unet, dataset=str(mixed_shapes))
    assert "images have different sizes" in error
    assert "set --image_size to resize them, or --bucket_by_size true" in error


@pytest.mark.parametrize("num_classes", [4, 1])
def test_padding_changes_neither_the_loss_nor_the_dice_counts(unet, num_classes):
    torch.manual_seed(0)
    logits = torch.randn(1, num_classes, 20, 24)
    target = torch.randint(0, unet_data.value_count(num_classes), (1, 20, 24))
    other = (torch.zeros(3, 40, 30, dtype=torch.uint8), torch.zeros(40, 30, dtype=torch.int64))
    x, y = unet_data.pad_collate([(torch.ones(3, 20, 24, dtype=torch.uint8), target[0]), other])
    assert x.shape == (2, 3, 48, 32) and y.shape == (2, 48, 32)  # the largest, rounded up to 16
    assert (y[0, 20:] == IGNORE).all() and (y[0, :, 24:] == IGNORE).all()
    assert (x[0, :, 20:] == 0).all()
    padded_logits = 10 * torch.randn(2, num_classes, 48, 32)  # whatever it says about the padding
    padded_logits[0, :, :20, :24] = logits[0]
    loss, padded_loss = (
        unet.loss_per_image(lg, t, num_classes)[0]
        for lg, t in ((logits, target), (padded_logits, y))
    )
    assert padded_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for a, b in zip(
        unet.dice_counts(logits, target, num_classes),
        unet.dice_counts(padded_logits, y, num_classes),
    ):
        assert torch.equal(a[0], b[0])


@pytest.mark.slow
def test_bucket_by_size_on_two_processes_trains_and_evaluates_every_image_once(
    mixed_shapes, tmp_path
):
    args = [
        RECIPE,
        "--dataset",
        mixed_shapes,
        *FAST,
        "--bucket_by_size",
        "true",
        "--base_channels",
        8,
    ]
    res = launch(
        [
            *args,
            "--output_dir",
            tmp_path / "train",
            "--epochs",
            2,
            "--batch_size",
            2,
            "--num_workers",
            2,
        ],
        nproc=2,
        env=ONE_THREAD,
    )
    assert_ok(res)
    # The start-up line and config.yaml give the pixel budget in use, not "batch 2 per process".
    assert f"batches of at most {2 * 96 * 96} padded pixels per process" in res.output, res
    assert "validation images of their own sizes" in res.output
    assert "batch 2 per process" not in res.output
    config = yaml.safe_load((tmp_path / "train" / "config.yaml").read_text())
    assert config["max_batch_pixels"] == 2 * 96 * 96
    rows = read_metrics(tmp_path / "train")
    assert [r["eval_samples"] for r in rows] == [N_MIXED_VAL, N_MIXED_VAL]
    assert rows[0]["world_size"] == 2
    # One process, the same weights: the same batches of the same images, so the same Dice.
    weights = tmp_path / "train" / "model.safetensors"
    # Predict: each image at its own size.
    assert SegmentationWeights.read(weights).input_size is None
    res = launch(
        [*args, "--output_dir", tmp_path / "eval", "--eval_only", "--weights", weights],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    (row,) = read_metrics(tmp_path / "eval")
    assert row["eval_samples"] == N_MIXED_VAL
    assert row["dice"] == pytest.approx(rows[-1]["dice"], abs=1e-9)
    # Predict keeps each image at its own size too.
    odd = Image.open(next((mixed_shapes / "imgs").glob("*.png"))).resize((61, 37))
    odd.save(tmp_path / "odd.png")
    assert_ok(
        launch(
            [
                RECIPE,
                "--predict",
                tmp_path / "odd.png",
                "--weights",
                weights,
                "--predict_dir",
                tmp_path / "out",
            ],
            launcher="python",
        )
    )
    assert Image.open(tmp_path / "out" / "odd_mask.png").size == (61, 37)


@pytest.mark.slow
def test_bucket_by_size_resumes_bit_identically(mixed_shapes, tmp_path):
    # Decoded by 2 workers (the two-process test above reads them from the cache), flipped.
    args = [
        RECIPE,
        "--dataset",
        mixed_shapes,
        *FAST,
        "--bucket_by_size",
        "true",
        "--base_channels",
        8,
        "--batch_size",
        2,
        "--num_workers",
        2,
        "--epochs",
        2,
        "--cache_images",
        "false",
        "--vflip",
        0.5,
    ]
    assert_resume_is_bit_identical(args, tmp_path, stop_at=7, steps=20)


@pytest.mark.slow
def test_num_classes_comes_from_the_masks_in_the_carvana_layout(shapes, tmp_path):
    # imgs/ + masks/ whose masks hold 0 and 255, and no --num_classes: two classes, not an error.
    root = tmp_path / "binary"
    shutil.copytree(shapes, root)
    for mask in (root / "masks").glob("*.png"):
        binary = np.where(np.asarray(Image.open(mask)) > 0, 255, 0).astype(np.uint8)
        Image.fromarray(binary).save(mask)
    res = launch(
        [RECIPE, "--dataset", root, "--output_dir", tmp_path / "out", "--smoke", *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "classes: mask values 0,255; outputs to" in res.output
    stored = SegmentationWeights.read(tmp_path / "out" / "model.safetensors")
    assert stored.model["num_classes"] == 2


TINY_SEGMENTER = """
class TinySegmenter(torch.nn.Module):  # the user's own model: a few convolutions, no U
    def __init__(self, in_channels, num_classes, base_channels):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, base_channels, 3, padding=1),
            torch.nn.BatchNorm2d(base_channels), torch.nn.ReLU(),
            torch.nn.Conv2d(base_channels, num_classes, 1))

    def forward(self, x):
        return self.body(x)

"""
UNET_CHANGED_LINES = 2  # README "Make your own recipe" states this number


def changed_lines(original, copy):
    """How many lines of `original` the copy changed or removed (added lines not counted)."""
    import difflib

    diff = difflib.ndiff(original.splitlines(), copy.splitlines())
    return sum(line.startswith("- ") for line in diff)


@pytest.mark.slow
def test_a_unet_copy_with_its_own_model_trains_on_1_and_2_processes_and_predicts(shapes, tmp_path):
    original = (REPO / RECIPE).read_text()
    marker = "# ADAPT: your model: the Config fields that build it"
    source = original.replace(marker, TINY_SEGMENTER + marker)
    source = source.replace(
        'MODEL_SETTINGS = ("in_channels", "num_classes", "base_channels", "bilinear")',
        'MODEL_SETTINGS = ("in_channels", "num_classes", "base_channels")',
    )
    source = source.replace("    return UNet(**settings)", "    return TinySegmenter(**settings)")
    assert changed_lines(original, source) == UNET_CHANGED_LINES
    copy = REPO / "recipes" / f"my_segmenter_{tmp_path.name[-8:]}.py"
    copy.write_text(source)
    try:
        args = [copy, "--dataset", shapes, *FAST, "--base_channels", 8, "--smoke"]
        one = launch([*args, "--output_dir", tmp_path / "one"], launcher="python", env=ONE_THREAD)
        two = launch([*args, "--output_dir", tmp_path / "two"], nproc=2, env=ONE_THREAD)
        weights = tmp_path / "two" / "model.safetensors"
        predicted = launch(
            [
                copy,
                "--predict",
                shapes / "imgs" / "shape_0000.png",
                "--weights",
                weights,
                "--predict_dir",
                tmp_path / "masks",
            ],
            launcher="python",
        )
    finally:
        copy.unlink()
    for res, out in ((one, "one"), (two, "two")):
        assert_ok(res)
        assert read_metrics(tmp_path / out)[0]["eval_samples"] == N_VAL
    assert SegmentationWeights.read(weights).model == {
        "in_channels": 3,
        "num_classes": 4,
        "base_channels": 8,
    }
    with safe_open(weights, "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"body"}  # the copy's model, not the U-Net
    assert_ok(predicted)
    mask = Image.open(tmp_path / "masks" / "shape_0000_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= VALUES


GREY_LOSS = """def loss_per_image(logits, target, num_classes):  # cross-entropy, padding left out
    ce = F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction="none")
    return ce.sum((1, 2)) / (target != IGNORE).sum((1, 2)).clamp(min=1)
"""
GREY_CHANGED_LINES = 16  # input_channels' line and the 15 lines of the recipe's loss


@pytest.mark.slow
def test_a_unet_copy_for_grey_images_with_its_own_loss_trains_and_predicts(shapes, tmp_path):
    # What a user with 1-channel images of 3 classes changes: in the copied recipe only.
    original = (REPO / RECIPE).read_text()
    start = original.index("def loss_per_image(")
    source = original[:start] + GREY_LOSS + original[original.index("\n\n\n", start) + 1 :]
    # Read every image as grey, even one saved as RGB.
    source = source.replace(
        '    return 1 if mode in ("1", "L", "I", "I;16", "F") else 4 if mode in '
        '("RGBA", "LA", "PA") else 3',
        "    return 1",
    )
    assert changed_lines(original, source) == GREY_CHANGED_LINES
    root = tmp_path / "grey"  # grey images, with one left in RGB, and 3 classes: 255 joins 170
    for folder in ("imgs", "masks"):
        (root / folder).mkdir(parents=True)
    for i, path in enumerate(sorted((shapes / "imgs").glob("*.png"))):
        Image.open(path).convert("RGB" if i == 5 else "L").save(root / "imgs" / path.name)
    for path in (shapes / "masks").glob("*.png"):
        mask = np.asarray(Image.open(path))
        merged = np.where(mask == 255, 170, mask).astype(np.uint8)
        Image.fromarray(merged).save(root / "masks" / path.name)
    copy = REPO / "recipes" / f"my_grey_{tmp_path.name[-8:]}.py"
    copy.write_text(source)
    try:
        res = launch(
            [
                copy,
                "--dataset",
                root,
                *FAST,
                "--base_channels",
                8,
                "--smoke",
                "--output_dir",
                tmp_path / "out",
            ],
            launcher="python",
            env=ONE_THREAD,
        )
        weights = tmp_path / "out" / "model.safetensors"
        predicted = launch(
            [
                copy,
                "--predict",
                shapes / "imgs" / "shape_0000.png",
                "--weights",
                weights,
                "--predict_dir",
                tmp_path / "masks",
            ],
            launcher="python",
        )
    finally:
        copy.unlink()
    assert_ok(res)
    assert "; L images; " in res.output and "classes: mask values 0,85,170;" in res.output, res
    stored = SegmentationWeights.read(weights)
    assert stored.model["in_channels"] == 1 and stored.model["num_classes"] == 3
    assert_ok(predicted)  # an RGB image, read in the weights' 1 channel
    mask = Image.open(tmp_path / "masks" / "shape_0000_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= {0, 85, 170}
