"""The text recipe's serving: predict, export and the data check, with the recipe's own model,
input and data (recipes/text.py, which trains, imports nothing of this file; given --predict,
--export or --check_data it runs this file in its place):

    python recipes/text_predict.py --weights runs/text/model.safetensors "mail/*.txt"
    python recipes/text.py --predict "mail/*.txt" --weights runs/text/model.safetensors
    python recipes/text_predict.py --export onnx --weights runs/text/model.safetensors
    python recipes/text_predict.py --check_data --dataset data/spam

Its settings are the recipe's Config and predict's own (ServingConfig). The weights file records the
model's settings, its classes and its tokenizer, so predict and export need no other flag. A copy of
the recipe copies this file too and points the import marked ADAPT at the copy: the model and the
data come with it.
"""

import glob
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np
import torch
import torch.nn.functional as F

from common.accelerator import accelerator_for, close
from common.checkpoint import load_weights
from common.config import UserError, require_at_least
from common.data import DataError
from common.export import OnnxModel, export_onnx
from common.outputs import stop_together, write_csv
from common.runtime import run_serving
from common.text.data import (
    TokenSet,
    check_splits,
    duplicate_groups,
    duplicates_across,
    length_histogram,
    length_summary,
    not_utf8,
    read_bytes,
)
from text import (  # ADAPT: your recipe (its model and data come with it)
    NAME,
    PAD_MULTIPLE,
    Config,
    Tokenizer,
    build_model,
    list_documents,
    loss_of,
    read_trained,
)


@dataclass
class ServingConfig(Config):
    # Predict (text_predict.py "mail/*.txt" --weights FILE): a CSV row per file.
    top_k: int = 1  # the most likely classes per file, each with its probability (bag: score)
    predict_csv: str = ""  # where the CSV goes; empty: predictions.csv beside the weights

    def validate(self):
        super().validate()
        require_at_least(self, 1, "top_k")


def serve(cfg):
    """--predict, --export or --check_data, on the processes of the accelerate config."""
    accelerator = accelerator_for(cfg)
    if cfg.predict:
        predict(cfg, accelerator)
    elif cfg.export:
        export(cfg, accelerator)
    else:
        check_data(cfg, accelerator)
    close(accelerator)


def trained_model(path, device="cpu"):
    """(model, record, tokenizer) for predict and export: the model that the weights file's
    record describes, with its weights, in eval mode (an .onnx file: an onnxruntime session that
    is called alike), and the tokenizer it was trained with."""
    record = read_trained(path)
    if record is None:
        raise UserError(
            f"{path} holds no settings of the {NAME} recipe: predict and export need a "
            f"model.safetensors that its training wrote"
        )
    tokenizer = Tokenizer.from_record(record["tokenizer"], record["model"]["max_length"])
    if Path(path).suffix == ".onnx":
        return OnnxModel(path), record, tokenizer
    model = build_model(record["model"], len(record["classes"]), tokenizer, record["encoder"])
    load_weights(model, path)
    return model.to(device).eval(), record, tokenizer


def predict_files(pattern):
    """The files that the --predict glob matches (** too), sorted."""
    files = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"--predict {pattern!r} matches no file: check the pattern (quote it)")
    return files


def predict(cfg, accelerator):
    """A CSV row per file of the --predict glob, in sorted order: the file, the names of its
    top_k classes and their probabilities, or the bag's scores (a linear SVM's, trained by
    squared_hinge: not probabilities). Each process does a share of the files, read as bytes
    and cut as in training, in batches of similar lengths (eval_batch_size files at most)."""
    model, record, tokenizer = trained_model(cfg.weights, accelerator.device)
    classes = record["classes"]
    # Cross-entropy's logits give probabilities (softmax); the bag's SVM scores stay scores.
    scores = loss_of(record["model"]["model"]) is not F.cross_entropy
    if cfg.top_k > len(classes):
        raise UserError(f"top_k {cfg.top_k} is more than the model's {len(classes)} classes")
    files = predict_files(cfg.predict)  # every process lists them all
    rows = {}
    with accelerator.split_between_processes(files) as share, stop_together(accelerator):
        texts = [read_bytes(path) for path in share]
        empty = [path for path, text in zip(share, texts) if not text]
        if empty:
            raise DataError(f"{empty[0]} is empty: a model cannot label no text; remove it")
        documents = TokenSet(tokenizer.encode(texts), [0] * len(share), share, PAD_MULTIPLE)
        by_length = np.argsort(documents.lengths, kind="stable")
        for start in range(0, len(share), cfg.eval_batch_size):
            batch = by_length[start : start + cfg.eval_batch_size].tolist()
            x, _ = documents.__getitems__(batch)
            with torch.inference_mode(), accelerator.autocast():
                outputs = model(x.to(accelerator.device)).float()
            if not scores:
                outputs = F.softmax(outputs, dim=1)
            top = outputs.topk(cfg.top_k, dim=1)  # sorted, most likely first
            for i, labels, chances in zip(batch, top.indices.tolist(), top.values.tolist()):
                row = [share[i]]
                for label, p in zip(labels, chances):
                    row += [classes[label], f"{p:.6f}"]
                rows[i] = row
    what = "score" if scores else "probability"
    header = ["file", "label", what]
    header += [f"{c}_{i}" for i in range(2, cfg.top_k + 1) for c in ("label", what)]
    path = cfg.predict_csv or Path(cfg.weights).parent / "predictions.csv"  # beside the weights
    ordered = [rows[i] for i in sorted(rows)]  # this process's files, in their sorted order
    count = write_csv(accelerator, ordered, path, header=header)  # gathered in order, written once
    accelerator.print(f"wrote {count} predictions to {path}")


EXAMPLE_LENGTHS = (200, 333, 1000, 57)  # export's check: documents of several lengths


def length_axis(max_length):
    """The ONNX graph's length axis: any multiple of PAD_MULTIPLE (as batches are padded), up to
    max_length's (0: any). torch.export needs it so: a free length would be specialised by the
    pooling and the patches."""
    blocks = torch.export.Dim("blocks", min=1, max=-(-max_length // PAD_MULTIPLE) or None)
    return PAD_MULTIPLE * blocks


def export(cfg, accelerator):
    """--export onnx: the weights as an .onnx file beside them, with dynamic batch and length
    axes, checked with onnxruntime against PyTorch on test documents of --dataset (random bytes
    where it is not here: weights copied from elsewhere) at two batch sizes and lengths."""
    model, record, tokenizer = trained_model(cfg.weights)
    try:
        _, test, _, _ = list_documents(cfg)
        texts, what = test.texts[: len(EXAMPLE_LENGTHS)], f"test documents of {cfg.dataset}"
    except DataError as e:
        rng = np.random.default_rng(0)
        texts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in EXAMPLE_LENGTHS]
        what = f"random bytes: {e}"
    documents = TokenSet(tokenizer.encode(texts), [0] * len(texts), texts, PAD_MULTIPLE)
    x, _ = documents.__getitems__(list(range(len(texts))))
    # Two blocks of PAD_MULTIPLE at least (padding): torch.export takes a dimension of size 1 (a
    # single block, as the few n-grams of short documents make) for a constant.
    x = F.pad(x, (0, max(0, 2 * PAD_MULTIPLE - x.shape[1])))
    shorter, _ = documents.__getitems__([len(texts) - 1])  # one document, another length
    export_onnx(
        accelerator,
        model,
        inputs=[x, shorter],
        weights=cfg.weights,
        metadata={"recipe": NAME},
        # Any number of documents, of any length padded to PAD_MULTIPLE (up to max_length's).
        dynamic={0: "batch", 1: length_axis(record["model"]["max_length"])},
        what=what,
        input_name="tokens",
    )


def check_data(cfg, accelerator, shown=3):
    """--check_data: the documents read as training reads them, with the same one-line errors for
    unreadable files; then each class's documents per split, their lengths (a histogram in
    output_dir/data_check.png, and the share that max_length cuts), empty files, identical
    documents and those that are not UTF-8; then the error that would stop training, if any."""
    train, test, classes, notes = list_documents(cfg)
    p = accelerator.print
    sizes = f"{len(train)} train / {len(test)} test documents of {len(classes)} classes"
    p(f"{NAME} data check: {sizes}")
    width = max(len(name) for name in classes) + 6
    p(f"{'class':<{width}}{cfg.train_split:>10}{cfg.test_split:>10}")
    counts = [np.bincount(d.labels, minlength=len(classes)) for d in (train, test)]
    for i, name in enumerate(classes):
        p(f"{i:<5} {name:<{width - 6}}{counts[0][i]:>10}{counts[1][i]:>10}")
    for note in notes:
        p(note)
    lengths = {}  # in bytes, whatever the tokenizer
    for split, docs in ((cfg.train_split, train), (cfg.test_split, test)):
        lengths[split] = [len(t) for t in docs.texts]
        if lengths[split]:
            p(f"{split}: {length_summary(lengths[split], cfg.max_length, 'bytes')}")
        problems = [
            ("empty", [n for n, t in zip(docs.names, docs.texts) if not t]),
            ("not valid UTF-8 (bytes tokens read them as they are)", not_utf8(docs)),
            ("in groups of identical documents", sum(duplicate_groups(docs), [])),
        ]
        for what, names in problems:
            if names:
                more = " ..." if len(names) > shown else ""
                p(f"{split}: {len(names)} documents {what}: {', '.join(names[:shown])}{more}")
    leaked = duplicates_across(train, test)
    if leaked:
        p(f"{cfg.test_split}: {len(leaked)} documents identical to training ones: {leaked[0]} ...")
    if accelerator.is_main_process:
        path = Path(cfg.output_dir) / "data_check.png"
        length_histogram(
            {k: v for k, v in lengths.items() if v}, path, max_length=cfg.max_length, unit="bytes"
        )
        print(f"wrote {path}: the documents' lengths in bytes, per split")
    check_splits(train, test, classes)  # what would stop training, as one line


if __name__ == "__main__":  # text_predict.py --weights W "mail/*.txt"
    run_serving(serve, ServingConfig, recipe=NAME, script=__file__)
