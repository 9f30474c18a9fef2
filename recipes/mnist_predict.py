"""MNIST's serving: predict, export and the data check, with the recipe's own model, input
conversion and data (recipes/mnist.py, which trains):

    python recipes/mnist_predict.py --weights runs/mnist/model.safetensors "digits/*.png"
    python recipes/mnist_predict.py --export onnx --weights runs/mnist/model.safetensors
    python recipes/mnist_predict.py --check_data --dataset data/mnist_sample

Its settings are the recipe's Config and predict's own (ServingConfig); `python recipes/mnist.py
--predict ...` runs this file in its place. A copy of the recipe copies this file too and points
its one import marked ADAPT at the copy (recipes/mnist.py never imports this file).
"""

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.accelerator import accelerator_for, close
from common.checkpoint import load_weights, read_record, record_metadata
from common.config import UserError, require_at_least
from common.data import image_files, read_image
from common.export import export_onnx
from common.outputs import stop_together, write_csv
from common.runtime import run_serving
from common.tracking import save_labelled
from mnist import (  # ADAPT: your recipe
    MODE,
    NAME,
    SIZE,
    Config,
    build_model,
    data_classes,
    make_loaders,
    normalize,
    to_batch,
)


@dataclass
class ServingConfig(Config):
    # Predict (--predict "digits/*.png" --weights FILE): a CSV row per file, in eval_batch_size.
    top_k: int = 3  # the most likely classes per file, each with its probability
    predict_csv: str = ""  # where the CSV goes; empty: predictions.csv beside the weights

    def validate(self):
        super().validate()
        require_at_least(self, 1, "top_k")


def serve(cfg):
    """--predict, --export or --check_data, on the processes of the accelerate config. The model
    has the classes that the weights file records (else those of --dataset)."""
    accelerator = accelerator_for(cfg)
    if cfg.check_data:
        check_data(cfg, accelerator)
        return close(accelerator)
    classes = read_record(cfg.weights, "classes") or data_classes(cfg)  # the weights' own
    model = build_model(classes)
    load_weights(model, cfg.weights)
    if cfg.predict:
        predict(cfg, accelerator, model, classes)
    else:  # an .onnx file beside the weights (common/export.py), checked on 8 inputs
        x, what = export_inputs(cfg, classes)
        export_onnx(
            accelerator,
            model,
            inputs=[normalize(x), normalize(x[:3])],
            weights=cfg.weights,
            metadata=record_metadata("classes", classes, recipe=NAME),
            dynamic={0: "batch"},  # any batch size
            what=what,
        )
    close(accelerator)


def export_inputs(cfg, classes, count=8):
    """(uint8 inputs [count, ...], what they are) that check an export: the first test digits of
    --dataset, whose classes must be the model's, or without --dataset random pixels of the
    images to_batch takes (MODE, SIZE): the weights need not come with their data, nor the
    machine reach the hub."""
    if cfg.dataset == Config.dataset:  # not given
        rng = np.random.default_rng(0)
        bands = len(Image.new(MODE, (1, 1)).getbands())
        noise = [rng.bytes(bands * SIZE[0] * SIZE[1]) for _ in range(count)]
        images = [Image.frombytes(MODE, SIZE, pixels) for pixels in noise]
        return to_batch(images, ["random pixels"] * count), "random pixels: no --dataset given"
    test_loader = make_loaders(cfg)[1]
    if test_loader.dataset.classes != classes:
        raise UserError(
            f"{cfg.weights} was trained on the classes {', '.join(classes)}; {cfg.dataset} has "
            f"{', '.join(test_loader.dataset.classes)}: give the --dataset it was trained on, or "
            f"leave out --dataset to check the export on random pixels"
        )
    return next(iter(test_loader))[0][:count], f"test images of {cfg.dataset}"


def predict(cfg, accelerator, model, classes):
    """Label the image files of the --predict glob: a CSV row per file, in sorted order, with the
    names of its top_k classes and their probabilities. Each process labels a share of the
    files, converted as in training (to_batch, normalize)."""
    if cfg.top_k > len(classes):
        raise UserError(f"top_k {cfg.top_k} is more than the model's {len(classes)} classes")
    files = image_files(cfg.predict)  # every process lists them all, so bad ones stop all alike
    model = model.to(accelerator.device).eval()
    rows = []
    with accelerator.split_between_processes(files) as share, stop_together(accelerator):
        for start in range(0, len(share), cfg.eval_batch_size):
            paths = share[start : start + cfg.eval_batch_size]
            x = to_batch([read_image(p) for p in paths], paths).to(accelerator.device)
            with torch.inference_mode(), accelerator.autocast():
                probabilities = F.softmax(model(normalize(x)).float(), dim=1)
            top = probabilities.topk(cfg.top_k, dim=1)  # sorted, most likely first
            for path, labels, chances in zip(paths, top.indices.tolist(), top.values.tolist()):
                row = [path]
                for label, p in zip(labels, chances):
                    row += [classes[label], f"{p:.6f}"]
                rows.append(row)
    header = ["file", "label", "probability"]
    header += [
        f"{column}_{i}" for i in range(2, cfg.top_k + 1) for column in ("label", "probability")
    ]
    path = cfg.predict_csv or Path(cfg.weights).parent / "predictions.csv"  # beside the weights
    count = write_csv(accelerator, rows, path, header=header)  # gathered in order, written once
    accelerator.print(f"wrote {count} predictions to {path}")


def check_data(cfg, accelerator, count=32):
    """--check_data: the data read as training reads it, with the same one-line errors; then
    each class's samples in each split, and `count` training images with their class names in
    output_dir/data_check.png, taken from each class in turn (a folder sorted by class shows
    them all). No training."""
    train_loader, test_loader = make_loaders(cfg)
    classes = train_loader.dataset.classes
    train_y, test_y = (loader.dataset.tensors[1] for loader in (train_loader, test_loader))
    accelerator.print(
        f"{NAME} data check: {len(train_y)} {cfg.train_split} / {len(test_y)} {cfg.test_split} "
        f"samples of {len(classes)} classes"
    )
    width = max(len(name) for name in classes) + 6
    accelerator.print(f"{'class':<{width}}{cfg.train_split:>10}{cfg.test_split:>10}")
    counts = [torch.bincount(y, minlength=len(classes)).tolist() for y in (train_y, test_y)]
    for i, name in enumerate(classes):
        accelerator.print(f"{i:<5} {name:<{width - 6}}{counts[0][i]:>10}{counts[1][i]:>10}")
    if accelerator.is_main_process:
        path = Path(cfg.output_dir) / "data_check.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        picked = each_class_in_turn(train_y, count)
        x, y = train_loader.dataset.tensors[0][picked], train_y[picked]
        save_labelled(x, [classes[i] for i in y.tolist()], path)
        print(f"wrote {path}: {len(y)} training images, each class in turn, with their classes")


def each_class_in_turn(labels, count):
    """The indices of up to `count` samples: the first of each class, then the second of each,
    and so on, in class order."""
    by_class = [torch.nonzero(labels == c).flatten().tolist() for c in labels.unique().tolist()]
    turns = itertools.zip_longest(*by_class)
    return [i for turn in turns for i in turn if i is not None][:count]


if __name__ == "__main__":  # mnist_predict.py --weights W "digits/*.png"
    run_serving(serve, ServingConfig, recipe=NAME, script=__file__)
