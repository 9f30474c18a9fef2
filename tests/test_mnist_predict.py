"""MNIST's --predict: image files labelled with saved weights into one CSV, on any number of
processes, the images converted as in training; bad input is one line naming the file and the
fix."""

import csv
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import assert_ok, error_lines, garble, launch, truncate
from PIL import Image
from recipe_module import load_recipe

from common.checkpoint import load_weights
from common.config import ConfigError, UserError, parse_config

MNIST, SERVING = "recipes/mnist.py", "recipes/mnist_predict.py"
HEADER = ["file", "label", "probability", "label_2", "probability_2", "label_3", "probability_3"]


def write_digits(tiny_mnist, folder, count=7):
    """The first `count` test digits of tiny_mnist as 28x28 'L' PNG files: their paths."""
    folder.mkdir()
    images = pq.read_table(tiny_mnist / "test.parquet").column("image").to_pylist()[:count]
    paths = [folder / f"digit_{i:02d}.png" for i in range(count)]
    for path, image in zip(paths, images):
        path.write_bytes(image["bytes"])  # the PNG the parquet file holds
    return paths


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def top_k(weights, paths, k=3):
    """The recipe's model on the images, computed here from the pixels: (labels, probabilities)
    of the k most likely classes of each image."""
    mnist = load_recipe("mnist")
    model = mnist.BasicNet(num_classes=10)
    load_weights(model, weights)
    x = torch.from_numpy(np.stack([np.asarray(Image.open(p)) for p in paths]))[:, None]
    with torch.inference_mode():
        probabilities = model.eval()(mnist.normalize(x)).softmax(1)
    top = probabilities.topk(k, dim=1)
    return top.indices.tolist(), top.values.tolist()


def test_predict_writes_one_row_per_file_in_order_the_same_on_two_processes(
    mnist_checkpoint, tiny_mnist, tmp_path
):
    weights = mnist_checkpoint / "model.safetensors"  # as the recipe writes it (max_steps 13)
    paths = write_digits(tiny_mnist, tmp_path / "digits")
    (tmp_path / "digits" / "notes.txt").write_text("not an image: not listed")
    out = tmp_path / "csv" / "labels.csv"
    # The serving file, as `recipes/mnist.py --predict` runs it in its own place (a launch of
    # that: test_own_data.py's --check_data, and test_template_copies.py's exports).
    res = launch(
        [SERVING, "--weights", weights, tmp_path / "digits" / "*", "--predict_csv", out], nproc=2
    )
    assert_ok(res)
    assert f"wrote 7 predictions to {out}" in res.output, res
    header, *rows = read_csv(out)
    assert header == HEADER
    assert [row[0] for row in rows] == sorted(map(str, paths))  # each file once, in sorted order
    labels, probabilities = top_k(weights, sorted(paths))  # what one process computes
    for row, want_labels, want_probabilities in zip(rows, labels, probabilities):
        assert [int(v) for v in row[1::2]] == want_labels, row
        got = [float(v) for v in row[2::2]]
        assert got == sorted(got, reverse=True) and all(0 <= p <= 1 for p in got), row
        assert got == pytest.approx(want_probabilities, abs=1e-5), row


# ---- slow tier: the one-line errors, the settings ----


def predict_here(*args):
    """The recipe's predict() in the test process, on one process, as --predict runs it; the
    weights are not read (the model is a fresh BasicNet)."""
    from common.accelerator import build_accelerator

    mnist = load_recipe("mnist")
    cfg = parse_config(
        load_recipe("mnist_predict").ServingConfig,
        ["--weights", "unused.safetensors", *map(str, args)],
    )
    classes = [str(i) for i in range(10)]
    serving = load_recipe("mnist_predict")
    serving.predict(cfg, build_accelerator(), mnist.BasicNet(num_classes=10), classes)


def broken(paths, how):
    """Make the last of `paths` bad: `how` is rgb, 32x32, garbled or truncated. Its path."""
    bad = paths[-1]
    if how == "rgb":
        Image.open(bad).convert("RGB").save(bad)
    elif how == "32x32":
        Image.open(bad).resize((32, 32)).save(bad)
    else:
        {"garbled": garble, "truncated": truncate}[how](bad)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, message",
    [
        ("rgb", "{bad} is a RGB 28x28 image; BasicNet takes 28x28 greyscale ('L'): convert it"),
        ("32x32", "{bad} is a L 32x32 image; BasicNet takes 28x28 greyscale ('L'): convert it"),
        ("garbled", "cannot read image {bad} (not an image file PIL can read): fix or remove"),
        ("truncated", "cannot read image {bad} (image file is truncated): fix or remove"),
    ],
)
def test_a_bad_image_names_the_file_and_the_fix(how, message, tiny_mnist, tmp_path):
    bad = broken(write_digits(tiny_mnist, tmp_path / "digits"), how)
    with pytest.raises(UserError, match=re.escape(message.format(bad=bad))):
        predict_here(
            "--predict", tmp_path / "digits" / "*.png", "--predict_csv", tmp_path / "p.csv"
        )
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.slow
def test_a_glob_that_matches_no_image_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("no image")
    pattern = tmp_path / "*"
    with pytest.raises(UserError, match=re.escape(f"--predict '{pattern}' matches no image files")):
        predict_here("--predict", pattern)


@pytest.mark.slow
def test_predict_settings_are_checked():
    config = load_recipe("mnist_predict").ServingConfig  # predict's settings: the serving file's
    for args, message in [
        (["--predict", "x.png"], "predict needs weights: add --weights FILE"),
        (
            ["--predict", "x.png", "--weights", "m.safetensors", "--eval_only"],
            "choose one of predict",
        ),
        (["--predict", "x.png", "--weights", "m.safetensors", "--export", "onnx"], "and export"),
        (["--top_k", "0"], "top_k must be at least 1, got 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(config, args)


@pytest.mark.slow
def test_a_bad_image_in_rank_1s_share_is_one_line_from_rank_0(
    mnist_checkpoint, tiny_mnist, tmp_path
):
    bad = broken(write_digits(tiny_mnist, tmp_path / "digits"), "rgb")  # in rank 1's share
    args = [MNIST, "--predict", tmp_path / "digits" / "*.png"]
    args += ["--weights", mnist_checkpoint / "model.safetensors", "--output_dir", tmp_path / "out"]
    line = f"error: {bad} is a RGB 28x28 image; BasicNet takes 28x28 greyscale ('L'): convert it"
    two = launch(args, nproc=2)  # rank 0 says rank 1's problem, once
    assert error_lines(two) == [line + " or change the model"], two
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_predictions_and_an_export_follow_the_weights_not_the_data(
    mnist_checkpoint, tiny_mnist, tmp_path, capsys
):
    from common.accelerator import build_accelerator

    mnist, serving = load_recipe("mnist"), load_recipe("mnist_predict")
    folder = tmp_path / "model-a"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes((mnist_checkpoint / "model.safetensors").read_bytes())
    # The CSV goes beside the weights, so that two models never overwrite each other's.
    paths = write_digits(tiny_mnist, tmp_path / "digits", count=3)
    cfg = parse_config(
        load_recipe("mnist_predict").ServingConfig,
        ["--predict", str(paths[0]), "--weights", str(weights)],
    )
    serving.predict(cfg, build_accelerator(), mnist.BasicNet(num_classes=10), mnist_classes())
    assert len(read_csv(folder / "predictions.csv")) == 2
    # Export without --dataset, where the hub cannot be reached (conftest's HF_ENDPOINT): the
    # check runs on random pixels of the model's input, and says so.
    serving.serve(
        parse_config(
            load_recipe("mnist_predict").ServingConfig,
            ["--export", "onnx", "--weights", str(weights)],
        )
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"wrote {weights.with_suffix('.onnx')}: ") and line.endswith(
        "on inputs of 8x1x28x28, 3x1x28x28 (random pixels: no --dataset given)"
    ), line
    # A dataset whose classes are not the weights': one line that names both and the fix.
    cfg = parse_config(
        load_recipe("mnist_predict").ServingConfig,
        ["--dataset", str(tiny_mnist), "--weights", str(weights)],
    )
    with pytest.raises(UserError) as error:
        serving.export_inputs(cfg, ["cat", "dog", "emu"])
    assert str(error.value) == (
        f"{weights} was trained on the classes cat, dog, emu; {tiny_mnist} has "
        f"{', '.join(mnist_classes())}: give the --dataset it was trained on, or leave out "
        f"--dataset to check the export on random pixels"
    )


def mnist_classes():
    return [str(i) for i in range(10)]
