"""The recipe trained as a user runs it, on 256 + 201 real digits of data/mnist_sample: on 2
processes every test digit counts once, a run stopped mid-epoch resumes to the same weights bit
for bit, and the weights predict and export."""

import csv

import pyarrow.parquet as pq
import pytest

from conftest import HERE, assert_same_weights, launch, metrics

RECIPE = "mnist"
N_TRAIN, N_TEST = 256, 201  # 201: no batch size here divides it, so the last batch is padded
RUN = ["--epochs", 2, "--batch_size", 32, "--eval_batch_size", 64]  # 8 steps an epoch


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The first rows of the shipped sample's splits, as train.parquet and test.parquet."""
    root = tmp_path_factory.mktemp("digits")
    for split, rows in (("train", N_TRAIN), ("test", N_TEST)):
        table = pq.read_table(HERE / "data" / "mnist_sample" / f"{split}.parquet")
        pq.write_table(table.slice(0, rows), root / f"{split}.parquet")
    return root


def train(digits, out, *more, processes=1):
    return launch(
        [f"{RECIPE}.py", "--dataset", digits, "--output_dir", out, *RUN, *more], processes
    )


@pytest.fixture(scope="module")
def straight(digits, tmp_path_factory):
    """One run of 2 epochs on 1 process, the others' reference: its output folder."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    train(digits, out)
    return out


def test_two_processes_train_and_count_every_test_digit_once(digits, straight, tmp_path):
    output = train(digits, tmp_path / "two", processes=2)
    assert "2 process(es) on" in output  # real DDP, over gloo on a machine without GPUs
    assert [row["eval_samples"] for row in metrics(tmp_path / "two")] == [N_TEST, N_TEST]
    # Its weights evaluated on 1 process: the same accuracy as on 2.
    weights = tmp_path / "two" / "model.safetensors"
    train(digits, tmp_path / "eval", "--eval_only", "--weights", weights)
    assert metrics(tmp_path / "eval")[-1]["accuracy"] == metrics(tmp_path / "two")[-1]["accuracy"]


def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(digits, straight, tmp_path):
    out = tmp_path / "stopped"
    train(digits, out, "--max_steps", 11)  # mid-epoch 2, as a preempted job would stop
    output = train(digits, out, "--resume", "latest")
    assert "step 11" in output
    assert_same_weights(out / "model.safetensors", straight / "model.safetensors")
    assert metrics(out)[-1]["accuracy"] == metrics(straight)[-1]["accuracy"]


def test_the_weights_predict_and_export(digits, straight, tmp_path):
    images = pq.read_table(digits / "test.parquet")["image"][:5].to_pylist()
    files = [tmp_path / f"digit_{i}.png" for i in range(len(images))]
    for file, image in zip(files, images):
        file.write_bytes(image["bytes"])
    weights = straight / "model.safetensors"
    launch([f"{RECIPE}_predict.py", "--weights", weights, tmp_path / "*.png"])
    with open(straight / "predictions.csv", newline="") as f:  # beside the weights
        assert [row[0] for row in list(csv.reader(f))[1:]] == [str(file) for file in files]
    launch([f"{RECIPE}.py", "--export", "onnx", "--weights", weights])  # the serving file exports
    assert weights.with_suffix(".onnx").is_file()
