"""The recipe trained as a user runs it, on 45 generated images with exact masks (make_shapes.py):
on 2 processes every validation image counts once, a run stopped mid-epoch resumes to the same
weights bit for bit, and the weights predict and export."""

import subprocess
import sys

import pytest

from conftest import HERE, assert_same_weights, launch, metrics

RECIPE = "unet"
N_IMAGES, N_VAL = 45, 9  # a fifth to validate: 9, which no batch size here divides
RUN = ["--base_channels", 8, "--lr", 3e-3, "--val_fraction", 0.2, "--num_workers", 0]
RUN += ["--epochs", 2, "--batch_size", 8, "--eval_batch_size", 4]  # 5 steps an epoch


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """45 images of 48x48 with circles, rectangles and triangles, and their masks."""
    root = tmp_path_factory.mktemp("shapes")
    maker = [sys.executable, HERE / "make_shapes.py", "--out", root, "--size", "48"]
    subprocess.run([*map(str, maker), "--count", str(N_IMAGES)], check=True, capture_output=True)
    return root


def train(shapes, out, *more, processes=1):
    return launch(
        [f"{RECIPE}.py", "--dataset", shapes, "--output_dir", out, *RUN, *more], processes
    )


@pytest.fixture(scope="module")
def straight(shapes, tmp_path_factory):
    """One run of 2 epochs on 1 process, the others' reference: its output folder."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    train(shapes, out)
    return out


def test_two_processes_train_and_count_every_validation_image_once(shapes, straight, tmp_path):
    output = train(shapes, tmp_path / "two", processes=2)
    assert "2 process(es) on" in output  # real DDP, over gloo on a machine without GPUs
    assert [row["eval_samples"] for row in metrics(tmp_path / "two")] == [N_VAL, N_VAL]
    # Its weights evaluated on 1 process: the same confusion counts, so the same mIoU, as on 2.
    weights = tmp_path / "two" / "model.safetensors"
    train(shapes, tmp_path / "eval", "--eval_only", "--weights", weights)
    assert metrics(tmp_path / "eval")[-1]["miou"] == metrics(tmp_path / "two")[-1]["miou"]


def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(shapes, straight, tmp_path):
    out = tmp_path / "stopped"
    train(shapes, out, "--max_steps", 7)  # mid-epoch 2, as a preempted job would stop
    output = train(shapes, out, "--resume", "latest")
    assert "step 7" in output
    assert_same_weights(out / "model.safetensors", straight / "model.safetensors")
    assert metrics(out)[-1]["miou"] == metrics(straight)[-1]["miou"]


def test_the_weights_predict_and_export(shapes, straight):
    weights = straight / "model.safetensors"
    launch([f"{RECIPE}_predict.py", "--weights", weights, shapes / "imgs" / "shape_000[0-4].png"])
    masks = sorted(p.name for p in (straight / "predictions").iterdir())  # beside the weights
    assert masks == [f"shape_000{i}_mask.png" for i in range(5)]
    launch([f"{RECIPE}.py", "--export", "onnx", "--weights", weights])  # the serving file exports
    assert weights.with_suffix(".onnx").is_file()
