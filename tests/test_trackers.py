"""Experiment trackers: TensorBoard scalars written by a real 2-process run, read back."""

import pytest

from conftest import assert_ok, launch, read_metrics


@pytest.mark.slow
def test_tensorboard_logs_training_and_eval_scalars(tiny_mnist, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = launch(["recipes/mnist.py", "--dataset", tiny_mnist, "--output_dir", tmp_path, "--epochs", 2,
                  "--batch_size", 16, "--log_with", "tensorboard", "--log_every", 2], nproc=2)
    assert_ok(res)
    (events,) = (tmp_path / "mnist").glob("events.out.tfevents.*")  # one writer: the main process
    acc = EventAccumulator(str(events))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/accuracy", "eval/eval_samples"} <= set(scalars)
    # 256 samples / (16 x 2 processes) = 8 steps per epoch, logged every 2 steps.
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12, 14, 16]
    rows = read_metrics(tmp_path)
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/accuracy")] == \
        [(r["step"], round(r["accuracy"], 6)) for r in rows]


@pytest.mark.slow
def test_a_missing_tracker_package_is_one_line(tiny_mnist, tmp_path):
    res = launch(["recipes/mnist.py", "--dataset", tiny_mnist, "--output_dir", tmp_path, "--log_with", "wandb"],
                 launcher="python")
    assert res.returncode == 2
    assert res.output.strip().splitlines() == [
        "error: log_with wandb needs the wandb package: pip install wandb"]
