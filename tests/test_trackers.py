"""Experiment trackers. The TensorBoard scalars of a 2-process MNIST run are read back in
test_ema_and_early_stop.py (its early-stopping run), the U-Net's panels in
test_unet_training.py."""

import pytest
from conftest import launch


@pytest.mark.slow
def test_a_missing_tracker_package_is_one_line(tiny_mnist, tmp_path):
    res = launch(
        [
            "recipes/mnist.py",
            "--dataset",
            tiny_mnist,
            "--output_dir",
            tmp_path,
            "--log_with",
            "wandb",
        ],
        launcher="python",
    )
    assert res.returncode == 2
    assert res.output.strip().splitlines() == [
        "error: log_with wandb needs the wandb package: pip install wandb"
    ]
