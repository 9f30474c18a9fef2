"""MNIST's serving: predict, export and the data check, with the recipe's own model, input
conversion and data (recipes/mnist.py, which trains):

    python recipes/mnist_predict.py --weights runs/mnist/model.safetensors "digits/*.png"
    python recipes/mnist_predict.py --export onnx --weights runs/mnist/model.safetensors
    python recipes/mnist_predict.py --check_data --dataset data/mnist_sample

Every setting is the recipe's Config; `python recipes/mnist.py --predict ...` runs this file in
its place. A copy of the recipe copies this file too and points its one import marked ADAPT at
the copy (recipes/mnist.py never imports this file).
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch
import torch.nn.functional as F

from common.accelerator import accelerator_for, close
from common.checkpoint import load_weights, read_record, record_metadata
from common.config import UserError
from common.data import image_files, read_image
from common.export import export_onnx
from common.outputs import stop_together, write_csv
from common.runtime import run_serving
from common.tracking import save_labelled
from mnist import (  # ADAPT: your recipe
    NAME,
    Config,
    build_model,
    data_classes,
    make_loaders,
    normalize,
    to_batch,
)


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
    else:  # an .onnx file beside the weights (common/export.py), checked on 8 test digits
        x = normalize(next(iter(make_loaders(cfg)[1]))[0][:8])
        export_onnx(
            accelerator,
            model,
            inputs=[x, x[:3]],
            weights=cfg.weights,
            metadata=record_metadata("classes", classes, recipe=NAME),
            dynamic={0: "batch"},  # any batch size
        )
    close(accelerator)


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
    path = cfg.predict_csv or Path(cfg.output_dir) / "predictions.csv"
    count = write_csv(accelerator, rows, path, header=header)  # gathered in order, written once
    accelerator.print(f"wrote {count} predictions to {path}")


def check_data(cfg, accelerator, count=32):
    """--check_data: the data read as training reads it, with the same one-line errors; then
    each class's samples in each split, and the first `count` training images with their class
    names in output_dir/data_check.png. No training."""
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
        x, y = train_loader.dataset.tensors[0][:count], train_y[:count]
        save_labelled(x, [classes[i] for i in y.tolist()], path)
        print(f"wrote {path}: the first {len(y)} training images, with their classes")


if __name__ == "__main__":  # mnist_predict.py --weights W "digits/*.png"
    run_serving(serve, Config, recipe=NAME, script=__file__)
