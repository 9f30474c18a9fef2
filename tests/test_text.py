"""The text recipe's contracts, on the shared launches of the fast tier: a copy of the recipe
whose model writes down the documents it trains on (also the template test on 2 processes),
trained on 2 real processes; its mid-epoch checkpoint resumed bit-exact; predict from its
weights. What a launch adds nothing to is checked in this process: bad data stopping a run too."""

import ast
import csv
import shutil

import pytest
import torch
from conftest import (
    REPO,
    assert_ok,
    launch,
    read_metrics,
    run_here,
    stopped_at,
)
from recipe_module import load_recipe
from safetensors.torch import load_file
from text_corpus import CNN, N_TEST, N_TRAIN, RECORDING_MODEL, SETTINGS, batches, copied_text

from common.checkpoint import read_record
from common.config import ShowHelp, parse_config

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def recording_copy():
    """A copy of the recipe with its own model (a ByteCNN that writes down the ids of the
    documents it trains on): one for the module, as a checkpoint resumes only in its recipe."""
    with copied_text(model=RECORDING_MODEL) as (copy, changed):
        # README: a copy with its own model changes 1 line of the recipe (its model's import),
        # 1 of its serving file (the recipe's import) and 1 of the model file (the model's line).
        assert changed == {"text": 1, "text_predict": 1, "text_model": 1}
        yield copy


def train(copy, text_corpus, out, nproc, *more):
    """2 epochs of the recording copy on `text_corpus` into `out` (a checkpoint every 4 steps),
    the ids of each process's batches into out-ids/: (the ids' folder, the output)."""
    ids = out.with_name(f"{out.name}-ids")
    ids.mkdir()
    res = launch(
        [copy, "--dataset", text_corpus, "--output_dir", out, "--epochs", 2, *SETTINGS, *CNN]
        + ["--checkpoint_every_steps", 4, "--keep_checkpoints", 20, *more],
        nproc=nproc,
        env={"PROBE_OUT": str(ids), **ONE_THREAD},
    )
    assert_ok(res)
    return ids, res.output


@pytest.fixture(scope="module")
def two_processes(recording_copy, text_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("text2p") / "run"
    ids, output = train(recording_copy, text_corpus, out, 2)
    return out, batches(ids, 2), output


def test_two_processes_train_every_document_once_an_epoch_and_evaluate_each_once(
    two_processes, text_corpus
):
    out, (rank0, rank1), output = two_processes
    assert "2 process(es) on cpu, gloo" in output and "formed by length" in output, output
    rows = read_metrics(out)
    assert [r["eval_samples"] for r in rows] == [N_TEST, N_TEST]  # no padding, no loss
    assert len(rank0) == len(rank1), "as many batches on both processes: no hang at the end"
    per_epoch = len(rank0) // 2
    assert rows[-1]["step"] == 2 * per_epoch
    for epoch in (slice(0, per_epoch), slice(per_epoch, None)):
        seen = [i for ids, _ in rank0[epoch] + rank1[epoch] for i in ids]
        assert sorted(seen) == list(range(N_TRAIN)), "every document exactly once an epoch"
    assert rank0[:per_epoch] != rank0[per_epoch:], "a new order every epoch"
    for (a, length_a), (b, length_b) in zip(rank0, rank1):
        # A step's two batches come from one global batch: as many documents (or one apart),
        # padded to about the same length, within the budget.
        assert abs(len(a) - len(b)) <= 1 and max(len(a), len(b)) <= 8
        assert max(len(a) * length_a, len(b) * length_b) <= 8 * 1024
    assert all(r["padding"] < 0.1 for r in rows), rows  # batches by length pad little
    assert rows[-1]["accuracy"] > 0.8, rows  # the classes' words are learnt
    assert (out / "model.safetensors").is_file() and (out / "best.safetensors").is_file()
    # The documents it evaluated on, once each, so that a baseline can use the same split.
    with open(out / "test_documents.csv", newline="") as f:
        header, *listed = list(csv.reader(f))
    tested = sorted((text_corpus / "test").rglob("*.txt"))
    assert header == ["document", "label"]
    assert sorted(listed) == sorted([str(p), p.parent.name] for p in tested)


def test_a_mid_epoch_checkpoint_resumes_bit_exact(
    recording_copy, text_corpus, two_processes, tmp_path
):
    straight, (rank0, rank1), _ = two_processes
    resumed = stopped_at(straight, 4, tmp_path / "resumed")  # epoch 1, 4 steps in
    ids, output = train(recording_copy, text_corpus, resumed, 2, "--resume", "latest")
    assert "(epoch 1, step 4)" in output, output
    assert batches(ids, 2) == [rank0[4:], rank1[4:]], "the batches not yet trained, in order"
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_metrics(resumed)[-1]["accuracy"] == read_metrics(straight)[-1]["accuracy"]


def test_predict_writes_a_row_per_file_from_the_weights_alone(
    recording_copy, text_corpus, two_processes, tmp_path
):
    # The weights record the model, its classes and its tokenizer: no other flag.
    out, _, _ = two_processes
    files = sorted((text_corpus / "test").rglob("*.txt"))[:5]
    mail = tmp_path / "mail"
    mail.mkdir()
    for path in files:
        (mail / path.name).write_bytes(path.read_bytes())
    serving = recording_copy.with_name(f"{recording_copy.stem}_predict.py")
    weights = tmp_path / "model-a" / "model.safetensors"  # the CSV goes beside the weights
    weights.parent.mkdir()
    shutil.copy(out / "model.safetensors", weights)
    csv_path = weights.parent / "predictions.csv"
    res = launch([serving, "--weights", weights, mail / "*.txt"], launcher="python")
    assert_ok(res)
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["file", "label", "probability"]
    assert [r[0] for r in rows[1:]] == [str(mail / p.name) for p in files]
    truth = [p.parent.name for p in files]
    assert sum(r[1] == t for r, t in zip(rows[1:], truth)) >= 4, (rows, truth)
    assert all(0.5 <= float(r[2]) <= 1 for r in rows[1:])


def test_the_default_trains_the_same_steps_on_two_processes_and_goes_on_on_one(
    text_corpus, tmp_path
):
    # The bag of word n-grams with its global batch: 2 processes share each step's 32 documents
    # (8 each, 2 accumulated), and a checkpoint of theirs resumes mid-epoch on 1 process (8 x 4)
    # to the same weights, the vocabulary read back from the checkpoint (dropout off: its masks
    # are drawn per process).
    straight, resumed = tmp_path / "two", tmp_path / "resumed"
    args = ["recipes/text.py", "--dataset", text_corpus, "--epochs", 2, *SETTINGS, "--dropout", 0]
    args += ["--checkpoint_every_steps", 3, "--keep_checkpoints", 20]
    two = launch([*args, "--output_dir", straight], nproc=2, env=ONE_THREAD)
    assert_ok(two)
    assert "global batch 32 = 8 per process x 2 process(es) x 2 accumulation step(s)" in two.output
    assert "bag (" in two.output and "on word 1-2 grams (" in two.output, two.output
    stopped_at(straight, 3, resumed)
    one = launch([*args, "--output_dir", resumed, "--resume", "latest"], nproc=1, env=ONE_THREAD)
    assert_ok(one)
    assert "8 per process x 1 process(es) x 4 accumulation step(s)" in one.output
    assert "(epoch 1, step 3)" in one.output, one.output
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # float sums' order only
    rows = read_metrics(straight)
    assert rows[-1]["eval_samples"] == N_TEST and rows[-1]["accuracy"] > 0.9, rows
    assert read_record(straight / "model.safetensors", "text")["tokenizer"]["kind"] == "words"


# ---- In this process ----


@pytest.fixture(scope="module")
def text():
    return load_recipe("text")


def test_an_empty_document_stops_the_run_with_one_line(text, text_corpus, tmp_path, capsys):
    bad = tmp_path / "bad"
    (bad / "train" / "ham").mkdir(parents=True)
    (bad / "train" / "spam").mkdir(parents=True)
    for path in (text_corpus / "train").rglob("*.txt"):
        (bad / "train" / path.parent.name / path.name).write_bytes(path.read_bytes())
    (bad / "train" / "spam" / "empty.txt").write_bytes(b"")
    out = tmp_path / "out"
    # In this process, as `python recipes/text.py` runs it: every process reads every document,
    # so each stops alike, and a launch adds only its start (launched: test_text_variants.py's
    # data check, which names the same document with the same line).
    code = run_here(text, ["--dataset", bad, "--output_dir", out, "--smoke"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error")] == [
        f"error: {bad / 'train' / 'spam' / 'empty.txt'} is empty: remove it, or give it its text"
    ]
    assert not out.exists(), "a run that stops before training leaves none"


def test_help_lists_every_setting_with_its_comment(text):
    with pytest.raises(ShowHelp) as shown:
        parse_config(text.Config, ["--help"])
    assert "--global_batch_size INT (default: 32)  documents per optimizer step" in str(shown.value)
    assert "--tokenizer STR (default: auto)" in str(shown.value)


def test_the_recipe_imports_no_serving_file(text):
    # Given --predict, it runs its serving file in its place (tested by launch in
    # test_text_variants.py); it never imports it, which imports the recipe.
    tree = ast.parse((REPO / "recipes" / "text.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "text_predict" not in imported, "no import circle: the serving file imports the recipe"
    assert text.SERVING.name == "text_predict.py"
