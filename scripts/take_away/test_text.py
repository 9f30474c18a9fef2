"""The recipe trained as a user runs it, on generated documents of two classes, 16 bytes to 3 KB
long: on 2 processes every test document counts once, a run stopped mid-epoch resumes to the
same weights bit for bit, and the weights predict and export."""

import csv

import numpy as np
import pytest

from conftest import assert_same_weights, launch, metrics

RECIPE = "text"
N_TRAIN, N_TEST = 101, 31  # odd: no process count or batch size here divides them
RUN = ["--batch_size", 8, "--eval_batch_size", 16, "--max_length", 1024]
RUN += ["--epochs", 2]
WORDS = {  # a quarter of each document's words are its class's own, the rest are shared
    "ham": ["meeting", "patch", "kernel", "thanks", "review", "lunch", "build", "release"],
    "spam": ["winner", "free", "money", "click", "offer", "cash", "prize", "urgent"],
}
SHARED = ["the", "a", "to", "of", "and", "mail", "list", "re:"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """train/<ham|spam>/doc_N.txt and test/<ham|spam>/doc_N.txt, lengths on a log scale."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for split, count in (("train", N_TRAIN), ("test", N_TEST)):
        for i in range(count):
            label = str(rng.choice(list(WORDS)))
            length, words = int(np.exp(rng.uniform(np.log(16), np.log(3000)))), []
            while len(" ".join(words)) < length:
                pool = WORDS[label] if rng.random() < 0.25 else SHARED
                words.append(str(rng.choice(pool)))
            (root / split / label).mkdir(parents=True, exist_ok=True)
            (root / split / label / f"doc_{split}_{i:03d}.txt").write_text(" ".join(words))
    return root


def train(corpus, out, *more, processes=1):
    return launch(
        [f"{RECIPE}.py", "--dataset", corpus, "--output_dir", out, *RUN, *more], processes
    )


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """One run of 2 epochs on 1 process, the others' reference: its output folder."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    train(corpus, out)
    return out


def test_two_processes_train_and_count_every_test_document_once(corpus, straight, tmp_path):
    output = train(corpus, tmp_path / "two", processes=2)
    assert "2 process(es) on" in output  # real DDP, over gloo on a machine without GPUs
    assert [row["eval_samples"] for row in metrics(tmp_path / "two")] == [N_TEST, N_TEST]
    # Its weights evaluated on 1 process: the same accuracy as on 2.
    weights = tmp_path / "two" / "model.safetensors"
    train(corpus, tmp_path / "eval", "--eval_only", "--weights", weights)
    assert metrics(tmp_path / "eval")[-1]["accuracy"] == metrics(tmp_path / "two")[-1]["accuracy"]


def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(corpus, straight, tmp_path):
    stop = metrics(straight)[0]["step"] + 3  # mid-epoch 2, as a preempted job would stop
    out = tmp_path / "stopped"
    train(corpus, out, "--max_steps", stop)
    output = train(corpus, out, "--resume", "latest")
    assert f"step {stop}" in output
    assert_same_weights(out / "model.safetensors", straight / "model.safetensors")
    assert metrics(out)[-1]["accuracy"] == metrics(straight)[-1]["accuracy"]


def test_the_weights_predict_and_export(corpus, straight, tmp_path):
    files = sorted((corpus / "test").glob("*/doc_test_00[0-4].txt"))  # of either class
    assert len(files) == 5
    weights, table = straight / "model.safetensors", tmp_path / "predictions.csv"
    pattern = corpus / "test" / "*" / "doc_test_00[0-4].txt"
    launch([f"{RECIPE}_predict.py", "--weights", weights, pattern, "--predict_csv", table])
    with open(table, newline="") as f:
        assert sorted(row[0] for row in list(csv.reader(f))[1:]) == sorted(map(str, files))
    launch([f"{RECIPE}.py", "--export", "onnx", "--weights", weights])  # the serving file exports
    assert weights.with_suffix(".onnx").is_file()
