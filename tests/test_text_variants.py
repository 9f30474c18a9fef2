"""The text recipe's variants (the slow tier): a global batch that resumes mid-epoch on another
process count with the same steps; evaluation that gives the same figures on 1 and 2 processes;
torchrun and bf16; the moving average and a tracker; export to ONNX and predict from it, on 2
processes too; the data check; a copy of the recipe as it is, on 1 process; memorising a batch;
bpe and chars, the words' byte grams."""

import csv
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BIN, assert_ok, error_lines, launch, read_metrics, stopped_at
from safetensors.torch import load_file
from text_corpus import (
    CNN,
    N_TEST,
    N_TRAIN,
    RECORDING_MODEL,
    SETTINGS,
    batches,
    copied_text,
    tiny_encoder,
)

from common.checkpoint import read_record

pytestmark = pytest.mark.slow
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
RECIPE, SERVING = "recipes/text.py", "recipes/text_predict.py"


@pytest.fixture(scope="module")
def recording_copy():
    with copied_text(model=RECORDING_MODEL) as (copy, _):
        yield copy


@pytest.fixture(scope="module")
def trained(text_corpus, tmp_path_factory):
    """One 2-process run of the recipe on `text_corpus`, 2 epochs: its output folder."""
    out = tmp_path_factory.mktemp("text_trained") / "run"
    res = launch(
        [RECIPE, "--dataset", text_corpus, "--output_dir", out, "--epochs", 2, *SETTINGS],
        nproc=2,
        env=ONE_THREAD,
    )
    assert_ok(res)
    return out


GLOBAL = 24  # documents per optimizer step, on any process count


def global_run(copy, text_corpus, out, nproc, batch_size, *more):
    ids = out.with_name(f"{out.name}-ids")
    ids.mkdir()
    res = launch(
        [copy, "--dataset", text_corpus, "--output_dir", out, "--epochs", 2, *SETTINGS, *CNN]
        + ["--global_batch_size", GLOBAL, "--batch_size", batch_size, "--dropout", 0]
        + ["--checkpoint_every_steps", 3, "--keep_checkpoints", 20, *more],
        nproc=nproc,
        env={"PROBE_OUT": str(ids), **ONE_THREAD},
    )
    assert_ok(res)
    return ids, res.output


def steps_of(per_rank, accumulation):
    """The document ids of every optimizer step, micro-step by micro-step, rank by rank."""
    return [
        [i for j in range(accumulation) for rank in per_rank for i in rank[s * accumulation + j][0]]
        for s in range(len(per_rank[0]) // accumulation)
    ]


def test_a_global_batch_resumes_mid_epoch_on_another_process_count(
    recording_copy,
    text_corpus,
    tmp_path,
):
    # 2 processes of 12 documents each; stopped after step 3 and resumed on 1 process, as 2
    # accumulated batches of 12: the same documents in every step.
    two = tmp_path / "two"
    ids, output = global_run(recording_copy, text_corpus, two, 2, 12)
    assert "global batch 24 = 12 per process x 2 process(es) x 1 accumulation step(s)" in output
    straight = steps_of(batches(ids, 2), 1)
    per_epoch = N_TRAIN // GLOBAL  # len % 24 documents left out, others every epoch
    assert len(straight) == 2 * per_epoch
    for epoch in (straight[:per_epoch], straight[per_epoch:]):
        assert all(len(set(step)) == GLOBAL for step in epoch)
        assert len({i for step in epoch for i in step}) == per_epoch * GLOBAL
    resumed = stopped_at(two, 3, tmp_path / "resumed")
    ids, output = global_run(recording_copy, text_corpus, resumed, 1, 12, "--resume", "latest")
    assert "global batch 24 = 12 per process x 1 process(es) x 2 accumulation step(s)" in output
    assert "(epoch 1, step 3)" in output
    assert steps_of(batches(ids, 1), 2) == straight[3:]
    a, b = load_file(two / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # float sums' order only


def test_evaluation_gives_the_same_figures_on_one_and_two_processes(trained, text_corpus, tmp_path):
    weights = trained / "model.safetensors"
    rows = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        res = launch(
            [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS]
            + ["--eval_only", "--weights", weights],
            nproc=nproc,
        )
        assert_ok(res)
        rows[nproc] = read_metrics(out)[-1]
    assert rows[1]["eval_samples"] == rows[2]["eval_samples"] == N_TEST
    assert rows[1]["accuracy"] == rows[2]["accuracy"] == read_metrics(trained)[-1]["accuracy"]
    assert rows[1]["eval_loss"] == pytest.approx(rows[2]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("launcher", ["torchrun", "bf16"])
def test_torchrun_and_bf16_train_on_two_processes(launcher, text_corpus, tmp_path):
    args = [
        RECIPE,
        "--dataset",
        text_corpus,
        "--output_dir",
        tmp_path / "out",
        *SETTINGS,
        "--smoke",
    ]
    if launcher == "torchrun":
        res = launch(args, nproc=2, launcher="torchrun", env=ONE_THREAD)
    else:  # a real bf16 autocast on the CPU
        res = launch(args, nproc=2, config="bf16.yaml", env=ONE_THREAD)
        assert "precision bf16" in res.output, res
    assert_ok(res)
    assert read_metrics(tmp_path / "out")[-1]["eval_samples"] == N_TEST


def test_the_moving_average_and_tensorboard(text_corpus, tmp_path):
    out = tmp_path / "out"
    res = launch(
        [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS, "--epochs", 2]
        + ["--ema_decay", 0.9, "--log_with", "tensorboard", "--log_every", 2],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    rows = read_metrics(out)
    assert all(r["ema_eval_samples"] == N_TEST and 0 < r["ema_accuracy"] <= 1 for r in rows)
    model, averaged = load_file(out / "model.safetensors"), load_file(out / "model_ema.safetensors")
    assert not torch.equal(model["embed.weight"], averaged["embed.weight"])
    assert list((out / "text").glob("events.out.tfevents.*")), "TensorBoard's event file"


@pytest.mark.parametrize("model", ["bag", "cnn", "transformer"])
def test_export_to_onnx_and_predict_from_it_on_two_processes(model, text_corpus, tmp_path):
    out = tmp_path / "out"
    train = [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS, "--model", model]
    assert_ok(launch([*train, "--smoke", "--width", 32], launcher="python", env=ONE_THREAD))
    weights = out / "model.safetensors"
    exported = launch(
        [SERVING, "--dataset", text_corpus, "--export", "onnx", "--weights", weights],
        launcher="python",
    )
    assert_ok(exported)
    assert f"(test documents of {text_corpus})" in exported.output, exported
    files = str(text_corpus / "test" / "*" / "*.txt")
    predictions = {}
    # The recipe runs its serving file in its place; the .onnx file predicts on 2 processes.
    for script, source, nproc in ((RECIPE, weights, 1), (SERVING, weights.with_suffix(".onnx"), 2)):
        path = tmp_path / f"{source.suffix[1:]}.csv"
        args = [script, "--weights", source, "--predict", files, "--predict_csv", path]
        res = launch(args, nproc=nproc)
        assert_ok(res)
        with open(path, newline="") as f:
            header, *predictions[source.suffix] = list(csv.reader(f))
        # The bag's outputs are a linear SVM's scores (squared_hinge), the others' logits.
        assert header == ["file", "label", "score" if model == "bag" else "probability"]
    torch_rows, onnx_rows = predictions[".safetensors"], predictions[".onnx"]
    assert len(torch_rows) == N_TEST and [r[0] for r in torch_rows] == sorted(
        r[0] for r in torch_rows
    )
    assert [r[:2] for r in onnx_rows] == [r[:2] for r in torch_rows]
    assert all(abs(float(a[2]) - float(b[2])) < 1e-4 for a, b in zip(onnx_rows, torch_rows))


def test_the_data_check_reports_and_names_what_would_stop_training(text_corpus, tmp_path):
    root = tmp_path / "docs"
    for path in text_corpus.rglob("*.txt"):
        target = root / path.relative_to(text_corpus)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    (root / "train" / "ham" / "empty.txt").write_bytes(b"")
    twin = next((root / "train" / "spam").iterdir())
    (root / "test" / "spam" / "twin.txt").write_bytes(twin.read_bytes())
    res = launch(
        [SERVING, "--check_data", "--dataset", root, "--output_dir", tmp_path / "check"]
        + ["--max_length", 1024],
        launcher="python",
    )
    lines = res.output.splitlines()
    assert lines[0].startswith(f"text data check: {N_TRAIN + 1} train / {N_TEST + 1} test"), res
    assert any(line.startswith("train: 1 documents empty:") for line in lines), res
    assert any("not valid UTF-8" in line for line in lines), res
    assert any(line.startswith("test: 1 documents identical to training ones") for line in lines)
    assert any("longer than max_length 1,024" in line for line in lines), res
    assert (tmp_path / "check" / "data_check.png").is_file()
    assert error_lines(res) == [
        f"error: {root / 'train' / 'ham' / 'empty.txt'} is empty: "
        + "remove it, or give it its text"
    ]


def test_a_copy_as_it_is_trains_predicts_and_passes_lint(text_corpus, tmp_path):
    with copied_text() as (copy, changed):
        assert changed == {"text": 0, "text_predict": 1}
        lint = subprocess.run(
            [BIN / "ruff", "check", copy, copy.with_name(f"{copy.stem}_predict.py")],
            capture_output=True,
            text=True,
        )
        out = tmp_path / "out"
        res = launch(
            [copy, "--dataset", text_corpus, "--output_dir", out, *SETTINGS, "--smoke"],
            launcher="python",
        )
        predicted = launch(
            [copy.with_name(f"{copy.stem}_predict.py"), "--weights", out / "model.safetensors"]
            + [text_corpus / "test" / "ham" / "*.txt", "--predict_csv", tmp_path / "p.csv"],
            launcher="python",
        )
    assert lint.returncode == 0, lint.stdout
    assert_ok(res)
    assert f"{copy.stem}: 1 process(es)" in res.output
    assert read_metrics(out)[-1]["eval_samples"] == N_TEST
    assert_ok(predicted)


def test_the_model_memorises_one_batch(text_corpus, tmp_path):
    out = tmp_path / "out"
    res = launch(
        [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS, "--overfit_batches", 1]
        + ["--epochs", 30, "--dropout", 0],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    rows = read_metrics(out)
    # One batch: the global batch's 32 documents, trained and evaluated on.
    assert rows[-1]["eval_samples"] == 32 and rows[-1]["accuracy"] == 1.0, rows[-1]


def test_bpe_subwords_are_kept_in_the_checkpoint_and_the_weights(text_corpus, tmp_path):
    # Trained on the training split once; a resume reads them back from its checkpoint, and
    # predict from the weights file, with no flag.
    out = tmp_path / "out"
    args = [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS]
    args += [*CNN, "--tokenizer", "bpe", "--vocab_size", 400, "--max_length", 256, "--epochs", 2]
    args_saved = [*args, "--checkpoint_every_steps", 5, "--keep_checkpoints", 20]
    assert_ok(launch(args_saved, launcher="python", env=ONE_THREAD))
    resumed = stopped_at(out, 5, tmp_path / "resumed")
    res = launch(
        [*args[:4], resumed, *args[5:], "--resume", "latest"], launcher="python", env=ONE_THREAD
    )
    assert_ok(res)
    assert "max_length 256 tokens" in res.output, res
    a, b = load_file(out / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    record = read_record(out / "model.safetensors", "text")
    assert record["tokenizer"]["kind"] == "bpe" and record["model"]["vocab_size"] == 400
    predicted = launch(
        [SERVING, "--weights", out / "model.safetensors", text_corpus / "test" / "*" / "*.txt"]
        + ["--predict_csv", tmp_path / "p.csv"],
        launcher="python",
    )
    assert_ok(predicted)


def test_chars_learns_words_that_training_never_had_by_their_endings(tmp_path):
    # Two classes of words that end in -ung and in -tion, each word made up for one document:
    # no test word is a training word, so words alone are at chance (1 of 2; checked); with
    # their byte grams (--tokenizer chars) the bag learns the endings. Predict reads them back.
    rng = np.random.default_rng(0)
    letters = np.array(list("bcdfghklmnprstvwz"))
    for label, ending in (("de", "ung"), ("fr", "tion")):
        (tmp_path / "docs" / label).mkdir(parents=True)
        for i in range(100):
            words = ["".join(rng.choice(letters, 5)) + ending for _ in range(6)]
            (tmp_path / "docs" / label / f"{i}.txt").write_text(" ".join(words))
    out = tmp_path / "out"
    args = [RECIPE, "--dataset", tmp_path / "docs", "--output_dir", out, "--tokenizer", "chars"]
    res = launch(args, launcher="python", env=ONE_THREAD)
    assert_ok(res)
    assert "on word 1-2 grams and their byte 2-4 grams" in res.output, res
    assert read_metrics(out)[-1]["accuracy"] == 1.0, read_metrics(out)[-1]
    with open(out / "test_documents.csv", newline="") as f:
        truth = {row["document"]: row["label"] for row in csv.DictReader(f)}
    listed = tmp_path / "listed"
    listed.mkdir()
    for document in truth:
        shutil.copy(document, listed / f"{Path(document).parent.name}-{Path(document).name}")
    predicted = launch(
        [SERVING, "--weights", out / "model.safetensors", listed / "*.txt"]
        + ["--predict_csv", tmp_path / "p.csv"],
        launcher="python",
    )
    assert_ok(predicted)
    with open(tmp_path / "p.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(truth) and all(
        r["label"] == Path(r["file"]).name.split("-")[0] for r in rows
    ), rows


def test_a_pretrained_encoder_by_folder_trains_predicts_and_exports_without_it(
    text_corpus, tmp_path
):
    # A tiny BERT made here, as a hub name would give one: fine-tuned with its own tokenizer,
    # then predicted and exported from the weights alone (the folder gone: the record rebuilds it).
    texts = [p.read_bytes().decode("latin-1") for p in sorted(text_corpus.rglob("*.txt"))]
    encoder = tiny_encoder(tmp_path / "tiny-bert", texts)
    out = tmp_path / "out"
    res = launch(
        [RECIPE, "--dataset", text_corpus, "--output_dir", out, *SETTINGS, "--smoke"]
        + ["--model", "pretrained", "--pretrained", encoder, "--max_length", 256],
        nproc=2,
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert f"{encoder} (" in res.output and "on its own tokenizer" in res.output, res
    assert read_metrics(out)[-1]["eval_samples"] == N_TEST
    shutil.rmtree(encoder)
    predicted = launch(
        [SERVING, "--weights", out / "model.safetensors", text_corpus / "test" / "*" / "*.txt"]
        + ["--predict_csv", tmp_path / "p.csv"],
        launcher="python",
    )
    assert_ok(predicted)
    assert f"wrote {N_TEST} predictions" in predicted.output
    exported = launch(
        [
            SERVING,
            "--dataset",
            text_corpus,
            "--export",
            "onnx",
            "--weights",
            out / "model.safetensors",
        ],
        launcher="python",
    )
    assert_ok(exported)
    missing = launch(
        [RECIPE, "--dataset", text_corpus, "--output_dir", tmp_path / "x", "--smoke"]
        + ["--model", "pretrained", "--pretrained", tmp_path / "nowhere"],
        launcher="python",
    )
    assert error_lines(missing) == [
        f"error: pretrained {tmp_path / 'nowhere'} does not exist: give a folder that "
        f"save_pretrained wrote, or a hub name"
    ]
