"""--overfit_batches N: a recipe trains and evaluates on the first N batches of the training data
(on each process), without augmentation, so that a user can check that the model and the loss can
learn their data at all (Lightning's overfit_batches, Karpathy's "overfit one batch"). Which
samples: in-process, for both recipes. That a U-Net memorises a few images whose classes differ
only by shape (scripts/make_digits.py --colours random), and MNIST a few batches: launched."""

import numpy as np
import pytest
import torch
import yaml
from conftest import ONE_THREAD, VAL_FRACTION, assert_ok, launch, make_digits, read_metrics
from PIL import Image
from recipe_module import load_recipe

import unet_rules
from common.config import parse_config


def test_the_first_batches_of_each_process_are_what_trains_and_what_evaluates(
    unet, shapes, tiny_mnist
):
    from common.accelerator import build_accelerator

    # U-Net: 2 batches of 4, on 1 process: the first 8 training pairs, in the order listed,
    # are both splits (the classes and the pixel counts are theirs).
    args = ["--dataset", shapes, "--val_fraction", VAL_FRACTION, "--num_workers", 0]
    cfg = parse_config(unet.Config, [str(a) for a in [*args, "--batch_size", 4]])
    overfit = parse_config(
        unet.Config,
        [str(a) for a in [*args, "--batch_size", 4, "--overfit_batches", 2, "--dropout", 0.5]],
    )
    settled, data, _ = unet.settle(overfit, build_accelerator())
    # Unaugmented, at a constant lr (a schedule fitted to a short run would lower it first), with
    # no dropout: can the model learn these batches by heart?
    assert (settled.hflip, settled.zoom, settled.scheduler) == (0, 0, "constant")
    assert (overfit.dropout, settled.dropout) == (0.5, 0)
    train_pairs, _ = unet.list_pairs(cfg)
    names = [name for _, _, name in train_pairs[:8]]
    for loader in (data.train_loader, data.val_loader):
        pairs = loader.dataset.pairs
        assert [pairs[i][2] for i in range(len(pairs))] == names
    assert sum(len(y) for _, y in data.val_loader) == 8
    # MNIST: 2 batches of 16 on each of 2 processes: the first 64 training digits, which
    # prepare() then deals out, 2 batches to each.
    mnist = load_recipe("mnist")
    args = ["--dataset", str(tiny_mnist), "--batch_size", "16"]
    everything, _ = mnist.make_loaders(parse_config(mnist.Config, args))
    overfit = parse_config(mnist.Config, [*args, "--overfit_batches", "2"])
    settled, *_ = mnist.settle(overfit, build_accelerator())
    assert (settled.shift, settled.scheduler, settled.gamma) == (0, "step", 1.0)
    for loader in mnist.make_loaders(overfit, processes=2):
        for got, expected in zip(loader.dataset.tensors, everything.dataset.tensors):
            assert torch.equal(got, expected[:64])


def test_the_overfit_check_says_which_classes_it_did_not_learn(unet):
    result = {"iou_per_class": {"background": 0.99, "seven": 0.41, "one": 0.85, "two": None}}
    assert unet_rules.overfit_verdict(result) == (
        "overfit check failed: 1 of 3 classes below IoU 0.8 (seven 0.41): train longer "
        "(--epochs) or at a higher --lr, then see docs/unet.md, Learning your classes"
    )
    result["iou_per_class"]["seven"] = 0.8
    assert unet_rules.overfit_verdict(result).startswith("overfit check passed")


@pytest.mark.slow
def test_a_unet_memorises_a_few_images_whose_classes_differ_only_by_shape(unet, tmp_path):
    # Digits in random colours over cluttered backgrounds, each outlined by void: only its shape
    # tells a digit's class. The first batch of the training split: 4 images of 48x48, with 3
    # to 6 classes. The class weights: a digit that another covers but for 40 pixels is learned
    # only with them (docs/unet.md, "Learning your classes").
    data = make_digits(
        tmp_path / "digits",
        *("--colours", "random", "--clutter", "4", "--digit_size", "0.46,0.625"),
        *("--band", "2", "--size", "48", "--count", "10"),
    )
    args = [
        *("--dataset", data, "--val_fraction", 0.2, "--ignore_index", 255),
        *("--overfit_batches", 1, "--batch_size", 4, "--num_workers", 0),
        *("--base_channels", 16, "--lr", 3e-3, "--class_weights", "auto", "--epochs", 60),
        *("--hflip", 0.5, "--zoom", 0.5, "--jitter", 0.3),  # turned off by overfit_batches
    ]
    out = tmp_path / "out"
    res = launch(["recipes/unet.py", *args, "--output_dir", out], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    # Evaluated on the very images it trained on: the first 4 of the training split, every
    # pixel but the void ones; every class in them (background and each digit) learned.
    train_pairs, _ = unet.list_pairs(parse_config(unet.Config, [str(a) for a in args]))
    masks = np.stack([np.asarray(Image.open(mask)) for _, mask, _ in train_pairs[:4]])
    last = read_metrics(out)[-1]
    assert last["eval_samples"] == 4 and last["eval_pixels"] == (masks != 255).sum()
    iou = last["iou_per_class"]  # by class name: here, the mask values
    assert sorted(int(c) for c in iou) == sorted(set(np.unique(masks).tolist()) - {255})
    assert len(iou) >= 4 and min(iou.values()) >= 0.9, last
    assert "overfit check passed: every class of these batches at IoU 0.8 or more" in res.output
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["hflip"], config["zoom"], config["jitter"]) == (0, 0, 0)  # as they are
    assert config["scheduler"] == "constant"  # the lr as given, throughout


@pytest.mark.slow
def test_mnist_memorises_its_first_batches(tiny_mnist, tmp_path):
    out = tmp_path / "out"
    res = launch(
        [
            "recipes/mnist.py",
            *("--dataset", tiny_mnist, "--overfit_batches", 2, "--batch_size", 16),
            *("--optimizer", "adamw", "--lr", 3e-3, "--gamma", 1, "--epochs", 10, "--shift", 2),
            *("--output_dir", out),
        ],
        launcher="python",
    )
    assert_ok(res)
    # 2 batches of 16: 32 training digits, the same 32 evaluated, all right, unshifted.
    rows = read_metrics(out)
    assert [r["eval_samples"] for r in rows] == [32] * 10
    assert rows[-1]["accuracy"] == 1.0, rows[-1]
    assert yaml.safe_load((out / "config.yaml").read_text())["shift"] == 0
