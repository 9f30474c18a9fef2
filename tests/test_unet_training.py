"""Training the U-Net recipe, launched as users launch it, on shapes made by
scripts/make_shapes.py: what a run learns and writes on 1 and 2 processes, exact evaluation, the
schedule, bit-identical resume, bucket_by_size, the images' channels, and bad settings."""

import csv
import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    FAST,
    LR,
    N_IMAGES,
    N_MIXED_VAL,
    N_VAL,
    ONE_THREAD,
    SIZE,
    VAL_FRACTION,
    VALUES,
    assert_ok,
    compile_config,
    launch,
    predict_here,
    read_metrics,
    relabelled,
    stopped_at,
    with_void,
)
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from common.config import ConfigError, parse_config
from common.data import DataError
from common.schedule import fit_cosine
from unet import read_trained
from unet_data import list_pairs

RECIPE = "recipes/unet.py"
N_TRAIN = N_IMAGES - N_VAL  # the training images of `shapes`


# ---- Training and exact evaluation on 1 and 2 processes ----


def all_background_dice(mask_dir):
    """The Dice of predicting background everywhere: the share of absent foreground classes."""
    masks = [set(np.unique(np.asarray(Image.open(p))).tolist()) for p in mask_dir.glob("*.png")]
    return float(np.mean([len(VALUES - m) / 3 for m in masks]))


@pytest.mark.slow
def test_single_process_learns_and_writes_the_output_contract(trained_unet, shapes):
    out, res = trained_unet
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
        "peak_memory_mb",
        "eval_peak_memory_mb",
    } <= rows[-1].keys()
    # On a CPU both are the process's resident set at its peak so far, which cannot be reset:
    # evaluation's, read after training's, is never below it (on a GPU each is its own).
    assert all(r["eval_peak_memory_mb"] >= r["peak_memory_mb"] > 0 for r in rows)
    assert rows[-1]["world_size"] == 1 and rows[-1]["eval_samples"] == N_VAL
    # The pairs it evaluated on, once each, so that another model can use the same split.
    with open(out / "val_images.csv", newline="") as f:
        header, *listed = list(csv.reader(f))
    assert header == ["image", "mask"] and len({image for image, _ in listed}) == N_VAL
    for image, mask in listed:
        assert Path(image).parent == shapes / "imgs" and Path(image).is_file()
        assert mask == str(shapes / "masks" / f"{Path(image).stem}_mask.png")
    assert rows[-1]["step"] == 10 * math.ceil(N_TRAIN / 8)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all_background_dice(shapes / "masks") < 0.6  # the best a model that learned nothing does
    assert rows[-1]["dice"] > 0.85, rows  # 0.94 to 0.98 with seeds 0 to 5
    assert yaml.safe_load((out / "config.yaml").read_text())["base_channels"] == 16
    # num_classes was left at 0: one class per mask value found. The weights file stores it, typed.
    stored = read_trained(out / "model.safetensors")
    assert stored["model"] == {
        "in_channels": 3,
        "num_classes": 4,
        "encoder": "",
        "base_channels": 16,
        "bilinear": False,
    }
    assert stored["mask_values"] == [0, 85, 170, 255] and stored["input_size"] == [SIZE, SIZE]
    assert (stored["ignored"], stored["colour_masks"], stored["scale"]) == ([], False, 0.0)
    # miou, and per class IoU and Dice, each evaluation; best.safetensors follows miou.
    assert all(0 < r["miou"] <= 1 and len(r["dice_per_class"]) == 4 for r in rows), rows
    state = json.loads(sorted((out / "checkpoints").glob("*/trainer_state.json"))[-1].read_text())
    assert state["best_miou"] == max(r["miou"] for r in rows)
    assert yaml.safe_load((out / "config.yaml").read_text())["num_classes"] == 4
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert "outc.weight" in keys and not any(k.startswith("module.") for k in keys)
    assert "classes: mask values 0,85,170,255" in res.output and f"outputs in {out}/" in res.output
    assert f"; fused AdamW lr {LR:g};" in res.output  # a CPU has the fused kernels (make_optimizer)
    # channels_last auto is off on a CPU; these images fit the cache (cache_images auto).
    assert (
        "; channels_last off (auto); images decoded once, 1 MB in cpu memory; evaluation "
        "batches of 4 images; 59 train" in res.output
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
            "--scheduler",
            "cosine",
            "--dropout",
            0.5,
        ],
        nproc=2,
    )
    assert_ok(res)
    assert "2 process(es) on cpu, gloo" in res.output and "; channels_last on; " in res.output
    # The model built, not the DDP wrapping it, and its dropout.
    assert "; RGB images; UNet (dropout 0.5 in its two deepest levels); " in res.output
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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm runs on GPUs only")
def test_two_gpus_use_syncbatchnorm(shapes, tmp_path):
    res = launch([RECIPE, "--dataset", shapes, "--output_dir", tmp_path, "--smoke", *FAST], nproc=2)
    assert_ok(res)
    assert "; SyncBatchNorm;" in res.output


# ---- The schedule ----


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
        "--scheduler",
        "cosine",
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


@pytest.mark.slow
def test_hold_cosine_holds_the_lr_then_falls_to_0_at_the_last_step(shapes, tmp_path):
    # 4 epochs of 8 steps: the lr held through 70% of the 32 steps, then the cosine to 0. An
    # epoch's line has the lr it began with.
    args = ["--dataset", shapes, "--output_dir", tmp_path, *FAST, "--base_channels", 4]
    args += ["--epochs", 4, "--scheduler", "hold_cosine"]
    assert_ok(launch([RECIPE, *args], launcher="python", env=ONE_THREAD))
    lrs = [row["lr"] for row in read_metrics(tmp_path)]
    start = 0.7 * 32  # 22.4: epoch 3 ends 1.6 steps into the cosine's 9.6
    falling = LR * (1 + math.cos(math.pi * (24 - start) / (32 - start))) / 2
    assert lrs == pytest.approx([LR, LR, LR, falling])
    state = tmp_path / "checkpoints" / "step-00000032" / "trainer_state.json"
    assert json.loads(state.read_text())["scheduler"]["_last_lr"][0] == pytest.approx(0, abs=1e-12)


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


# ---- Stop and resume, bit-identical ----


def assert_resume_is_bit_identical(args, out, stop_at, steps, nproc=1):
    """Training `steps` steps straight and resuming from its checkpoint at step `stop_at` (a
    mid-epoch one, written as a stop writes it) to `steps` give the same weights."""
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


def test_stop_and_resume_is_bit_identical_with_augmentation(camvid_two_processes, tmp_path):
    # Augmentation is seeded per (seed, epoch, sample), so with 2 persistent DataLoader workers
    # decoding on each of 2 processes, a resumed run sees the same crops, flips, zooms, rotations
    # and colours as an uninterrupted one, across an epoch end (4 steps an epoch). The shared
    # run (conftest: CamVid's layout, read by flags) ran 8 steps straight.
    run = camvid_two_processes
    split = stopped_at(run.out, 3, tmp_path / "split")  # mid-epoch 1
    res = launch(
        [*run.args, "--output_dir", split, "--max_steps", 8, "--resume", "latest"],
        nproc=2,
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "(epoch 1, step 3)" in res.output
    a, b = (load_file(out / "model.safetensors") for out in (run.out, split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Every validation pixel but Void's counted once in the confusion matrix behind miou, where
    # the prepared loader pads the last batch with duplicates (10 images, batches of 4 on 2).
    masks = [np.asarray(Image.open(p).convert("RGB")) for p in (run.root / "val_labels").iterdir()]
    pixels = sum(int((m != 0).any(-1).sum()) for m in masks)  # Void: black
    rows = read_metrics(run.out)
    assert len(masks) == 10 and [r["eval_pixels"] for r in rows] == [pixels] * 2, rows
    assert all(0 <= r["miou"] <= 1 and len(r["iou_per_class"]) == 5 for r in rows), rows
    # config.yaml records the settings as the run resolved them: channels_last auto is off on CPUs.
    config = yaml.safe_load((run.out / "config.yaml").read_text())
    assert (config["channels_last"], config["cache_images"]) == (False, False)


@pytest.mark.slow
def test_stop_and_resume_from_the_image_cache_is_bit_identical(shapes, tmp_path):
    # On 1 process, the images decoded once into memory (on 2 processes, decoded by workers:
    # above), 8 steps an epoch.
    args = [
        RECIPE,
        "--dataset",
        shapes,
        *FAST,
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
        *("--zoom", 0.25, "--rotate", 15, "--jitter", 0.3),
        "--cache_images",
        "true",
    ]
    assert_resume_is_bit_identical(args, tmp_path, stop_at=5, steps=12)
    rows = read_metrics(tmp_path / "straight")
    assert [r["eval_pixels"] for r in rows] == [N_VAL * SIZE * SIZE] * 2, rows
    config = yaml.safe_load((tmp_path / "straight" / "config.yaml").read_text())
    assert (config["channels_last"], config["cache_images"]) == (False, True)


# ---- bucket_by_size: each image trained and evaluated at its own size ----


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
def test_bucket_by_size_on_two_processes_trains_and_evaluates_every_image_once(
    mixed_shapes, unet, tmp_path
):
    # VOC's masks (class indices, void 255 along the edges) with the void ignored, and the
    # activations recomputed in the backward pass (grad_checkpointing) under DDP.
    data = relabelled(mixed_shapes, tmp_path / "voc", with_void)
    args = [
        RECIPE,
        "--dataset",
        data,
        *FAST,
        "--bucket_by_size",
        "true",
        "--base_channels",
        8,
        "--ignore_index",
        255,
        "--grad_checkpointing",
        "true",
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
    # Every pixel of the validation masks in miou's confusion matrix once, but for the void.
    _, val = list_pairs(unet.Config(dataset=str(data), val_fraction=VAL_FRACTION))
    masks = [np.asarray(Image.open(mask)) for _, mask, _ in val]
    assert [r["eval_pixels"] for r in rows] == [sum((m != 255).sum() for m in masks)] * 2
    # One process, the same weights: the same batches of the same images, so the same Dice.
    weights = tmp_path / "train" / "model.safetensors"
    # Predict: each image at its own size.
    assert read_trained(weights)["input_size"] is None
    res = launch(
        [*args, "--output_dir", tmp_path / "eval", "--eval_only", "--weights", weights],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    (row,) = read_metrics(tmp_path / "eval")
    assert row["eval_samples"] == N_MIXED_VAL
    assert row["dice"] == pytest.approx(rows[-1]["dice"], abs=1e-9)
    assert row["miou"] == pytest.approx(rows[-1]["miou"], abs=1e-9)
    assert row["eval_pixels"] == rows[-1]["eval_pixels"]
    # Predict keeps each image at its own size too, and never writes the ignored value.
    odd = Image.open(next((mixed_shapes / "imgs").glob("*.png"))).resize((61, 37))
    odd.save(tmp_path / "odd.png")
    predict_here(unet, weights, tmp_path / "odd.png", tmp_path / "out")
    predicted = Image.open(tmp_path / "out" / "odd_mask.png")
    assert predicted.size == (61, 37) and np.asarray(predicted).max() <= 3


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


# ---- The images' channels ----


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
    assert read_trained(weights)["model"]["in_channels"] == 1
    # Predict reads any image in the channels the weights were trained on.
    inputs = tmp_path / "in"
    inputs.mkdir()
    Image.open(shapes / "imgs" / "shape_0000.png").save(inputs / "rgb.png")
    Image.open(shapes / "imgs" / "shape_0001.png").convert("RGBA").save(inputs / "rgba.png")
    predict_here(unet, weights, f"{inputs}/*", tmp_path / "masks", "--overlay")
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
    from common.accelerator import build_accelerator

    cfg = unet.Config(
        dataset=str(recoloured(shapes, tmp_path / "rgba", "RGBA", 20)),
        val_fraction=0.2,
        cache_images=False,
        num_workers=0,
    )
    data = unet.load_data(cfg, build_accelerator())
    x, *_ = next(iter(data.train_loader))
    assert data.in_channels == 4 and x.shape[1] == 4 and x.dtype == torch.uint8


def test_images_of_different_channels_say_which_and_what_to_set(unet, shapes, tmp_path):
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
        unet.load_data(cfg, build_accelerator())
    # Set, in_channels reads them all alike.
    data = unet.load_data(replace(cfg, in_channels=3), build_accelerator())
    assert data.in_channels == 3 and next(iter(data.val_loader))[0].shape[1] == 3


# ---- Settings ----


def test_bad_settings_are_rejected(unet):
    for args, message in [
        (["--mask_values", "0,x"], "mask_values must be distinct non-negative integers"),
        (
            ["--num_classes", "4", "--mask_values", "0,255"],
            "mask_values needs one value per class (4 for num_classes 4)",
        ),
        (["--num_classes", "1", "--mask_values", "0,1,2"], "(2 for num_classes 1)"),
        (["--crop_size", "64", "--image_size", "48"], "crop_size cannot exceed image_size"),
        (["--image_size", "20"], "image_size must be SIZE or HxW (height x width), each at"),
        (["--image_size", "64x20"], "each at least 32 (the U-Net halves the image 4 times)"),
        (["--image_size", "64by64"], "like 512 or 640x960; got '64by64'"),
        (["--image_size", "64", "--scale", "0.5"], "choose one of image_size and scale"),
        (["--scale", "-1"], "scale must be above 0 (or 0: no resize), got -1.0"),
        (["--ignore_index", "void"], "--ignore_index must be distinct non-negative integers"),
        (["--class_weights", "1,x"], "class_weights must be auto or a non-negative weight"),
        (["--focal_gamma", "-2"], "focal_gamma must be 0 or more, got -2.0"),
        (["--best_metric", "accuracy"], "best_metric must be miou or dice, got 'accuracy'"),
        (["--encoder", "vgg16"], "encoder must be empty (the classic U-Net) or resnet18, resnet34"),
        (["--encoder", "resnet18", "--in_channels", "1"], "a resnet18 encoder takes RGB"),
        (["--encoder_weights", "x.pth"], "encoder_weights needs an encoder: add --encoder"),
        (["--scheduler", "step"], "scheduler must be cosine, hold_cosine, plateau, constant"),
        (["--fill", "black"], "fill must be reflect (the image mirrored past its edges) or zeros"),
        (["--dropout", "1"], "dropout must be 0 (none) to below 1, such as 0.5, got 1.0"),
        (["--copy_paste", "2"], "copy_paste is the share of training images that get another's"),
        (
            ["--bucket_by_size", "true", "--copy_paste", "0.5"],
            "copy_paste pastes between images of one size: set --image_size, not bucket_by_size",
        ),
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
