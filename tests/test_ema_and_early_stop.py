"""The moving average of the weights (ema_decay) and early stopping (early_stop_patience):
every rank stops after the same evaluation, and the patience survives a resume; the U-Net
averages its BatchNorm statistics too. The early-stopping run also logs to TensorBoard, read back
here. The moving average resumes exactly in test_resume.py (its 2-process run), and a checkpoint
resumes only with its ema_decay in test_invariants.py."""

import pytest
import torch
from conftest import (
    assert_ok,
    launch,
    make_shapes,
    read_metrics,
)
from recipe_module import load_recipe
from safetensors.torch import load_file

from common.config import ConfigError, parse_config

MNIST = "recipes/mnist.py"
# 256 train samples, batch 32: 8 optimizer steps per epoch on 1 process, 4 on 2.
COMMON = ["--epochs", 2, "--batch_size", 32, "--eval_batch_size", 256]


def train(data, out, *args, nproc=1):
    res = launch([MNIST, "--dataset", data, "--output_dir", out, *COMMON, *args], nproc=nproc)
    assert_ok(res)
    return res


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max()}"


@pytest.mark.slow
def test_early_stopping_stops_every_rank_its_patience_survives_a_resume_and_tensorboard_logs(
    tiny_mnist, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # A learning rate too small to change a prediction: the accuracy never improves after epoch 1.
    # 8 steps an epoch on 1 process: max_steps 16 stops at the end of epoch 2, one evaluation into
    # a patience of 2. That checkpoint, at an epoch's end, goes on on 2 processes, which must stop
    # after epoch 3, both of them, not start counting again.
    flat = ["--lr", 1e-12, "--epochs", 6, "--early_stop_patience", 2]
    train(
        tiny_mnist,
        tmp_path,
        *flat,
        "--max_steps",
        16,
        "--log_with",
        "tensorboard",
        "--log_every",
        2,
    )
    # TensorBoard: training scalars every 2 steps, and the evaluations. From the main process
    # alone on 2 processes: test_unet_training.py.
    (events,) = (tmp_path / "mnist").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {
        "train/loss",
        "train/lr",
        "train/samples_per_s",
        "eval/accuracy",
        "eval/eval_samples",
    } <= set(scalars)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(2, 17, 2))
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/accuracy")] == [
        (r["step"], round(r["accuracy"], 6)) for r in read_metrics(tmp_path)
    ]
    assert [r["step"] for r in read_metrics(tmp_path)] == [8, 16]

    res = train(tiny_mnist, tmp_path, *flat, "--resume", "latest", nproc=2)
    assert "stopped early: no better accuracy in 2 evaluations" in res.output
    epochs = [(r["epoch"], r["world_size"]) for r in read_metrics(tmp_path)]
    assert epochs == [(1, 1), (2, 1), (3, 2)]
    assert (tmp_path / "model.safetensors").is_file()
    # Going on from there trains nothing more: the patience ran out.
    res = train(tiny_mnist, tmp_path, *flat, "--resume", "latest")
    assert "epoch 4:" not in res.output and read_metrics(tmp_path)[-1]["epoch"] is None


@pytest.mark.slow
def test_the_unet_averages_its_batchnorm_and_stops_early(tmp_path):
    shapes = make_shapes(tmp_path / "shapes", 40, 48)
    out = tmp_path / "run"
    res = launch(
        [
            "recipes/unet.py",
            "--dataset",
            shapes,
            "--output_dir",
            out,
            "--base_channels",
            4,
            "--num_workers",
            0,
            "--val_fraction",
            0.2,
            "--batch_size",
            8,
            "--epochs",
            5,
            "--lr",
            1e-12,
            "--ema_decay",
            0.5,
            "--early_stop_patience",
            1,
        ],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert_ok(res)
    assert "stopped early: no better ema_miou in 1 evaluations" in res.output
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2]
    assert all("ema_dice" in r and "ema_miou" in r for r in read_metrics(out))
    averaged = load_file(out / "model_ema.safetensors")
    model = load_file(out / "model.safetensors")
    # BatchNorm's running statistics are averaged too (the weights barely move at this lr).
    mean = next(k for k in averaged if k.endswith("running_mean"))
    assert averaged[mean].abs().sum() > 0 and not torch.equal(averaged[mean], model[mean])
    assert torch.equal(
        averaged[mean.replace("running_mean", "num_batches_tracked")],
        model[mean.replace("running_mean", "num_batches_tracked")],
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ema_decay", "1"], "ema_decay must be in [0, 1), such as 0.999, got 1.0"),
        (["--early_stop_patience", "-1"], "early_stop_patience must be at least 0, got -1"),
    ],
)
def test_bad_values_are_rejected(argv, message):
    mnist = load_recipe("mnist")
    with pytest.raises(ConfigError) as e:
        parse_config(mnist.Config, argv)
    assert message in str(e.value)
