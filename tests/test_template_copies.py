"""Copies of the recipes made as README "Make your own recipe" says, with their own model (and
for grey images their own loss): each changes only the lines the README counts, trains on 1 and
2 processes, and predicts with its own weights (the MNIST copy exports them too)."""

import contextlib
import csv
import shutil
import subprocess
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import (
    BIN,
    FAST,
    N_TEST,
    ONE_THREAD,
    REPO,
    SIZE,
    assert_ok,
    changed_lines,
    copy_with_tiny_model,
    launch,
    predict_here,
    read_metrics,
)
from layouts import image_and_mask, split_names, voc_layout
from PIL import Image
from recipe_module import load_recipe
from safetensors import safe_open
from safetensors.torch import load_file

from common.checkpoint import read_record
from common.config import ConfigError, parse_config
from unet import read_trained

RECIPE = "recipes/unet.py"


# ---- MNIST ----


@pytest.mark.slow
def test_a_copy_with_its_own_model_is_a_working_template(tiny_mnist, tmp_path):
    # The copy trains on 1 process here, and on 2 in test_global_batch.py's fast tier (a copy
    # with a model of its own that records its batches). Its --export runs the copy's serving
    # file in its place; predict, that serving file's too, runs here.
    digits = tmp_path / "digits"  # 5 test digits as PNG files, for predict
    digits.mkdir()
    for i, image in enumerate(pq.read_table(tiny_mnist / "test.parquet")["image"][:5].to_pylist()):
        (digits / f"digit_{i}.png").write_bytes(image["bytes"])
    weights = tmp_path / "one" / "model.safetensors"
    with copy_with_tiny_model() as copy:
        one = launch(
            [copy, "--dataset", tiny_mnist, "--output_dir", tmp_path / "one", "--smoke"],
            launcher="python",
        )
        assert_ok(one)
        # The model is made in one place: predict and export take the copy's own.
        exported = launch(
            [copy, "--dataset", tiny_mnist, "--export", "onnx", "--weights", weights],
            launcher="python",
        )
        serving = load_recipe(f"{copy.stem}_predict")
        argv = ["--predict", str(digits / "*.png"), "--weights", str(weights)]
        serving.serve(parse_config(serving.ServingConfig, argv))
    assert read_metrics(tmp_path / "one")[0]["eval_samples"] == N_TEST
    assert set(load_file(weights)) == {"fc.weight", "fc.bias"}
    with open(weights.parent / "predictions.csv", newline="") as f:  # beside the weights
        rows = list(csv.reader(f))[1:]
    assert [row[0] for row in rows] == [str(digits / f"digit_{i}.png") for i in range(5)]
    assert_ok(exported)
    assert weights.with_suffix(".onnx").is_file()


# ---- U-Net ----


@contextlib.contextmanager
def copied_unet(name, *, recipe=None, data=None, model=None):
    """The U-Net copied as README "Make your own recipe" says: recipes/NAME.py (`recipe`: the
    edited text of unet.py, else as it is) and its serving file recipes/NAME_predict.py, with
    `data` (the text of the copy's data file) recipes/NAME_data.py and with `model` (the text of
    the copy's model file) recipes/NAME_model.py, each file's imports pointed at the others.
    Yields (the recipe's path, {file: lines of the original it changed}; a new model file counts
    all its lines), and deletes them on leaving."""
    originals = {f: (REPO / "recipes" / f"{f}.py").read_text() for f in UNET_FILES}
    texts = {"unet": recipe or originals["unet"], "unet_predict": originals["unet_predict"]}
    texts["unet_predict"] = texts["unet_predict"].replace("from unet import", f"from {name} import")
    for part, text in (("data", data), ("model", model)):
        if text is not None:
            texts[f"unet_{part}"] = text
            texts["unet"] = texts["unet"].replace(
                f"from unet_{part} import", f"from {name}_{part} import"
            )
    paths = {f: REPO / "recipes" / f"{f.replace('unet', name, 1)}.py" for f in texts}
    for f, text in texts.items():
        paths[f].write_text(text)
    try:
        yield paths["unet"], {f: changed_lines(originals[f], texts[f]) for f in texts}
    finally:
        for path in paths.values():
            path.unlink()


UNET_FILES = ("unet", "unet_predict", "unet_data", "unet_model")


def short_name():
    """A copy's name as a user gives it (my_seg), made unique: my_ and 4 hex digits."""
    return f"my_{uuid.uuid4().hex[:4]}"


TINY_MODEL = '''"""A copy's own model file: a few convolutions, no U, and only its settings."""

from dataclasses import dataclass

import torch

from common.config import require

PAD_MULTIPLE = 16  # the sides that padded batches and predict's tiles keep to
MIN_SIZE = 32
MODEL_SETTINGS = ("in_channels", "num_classes", "base_channels")


@dataclass
class ModelConfig:
    # Model.
    in_channels: int = 0  # 1 grey, 3 RGB; 0: the images' own
    base_channels: int = 8  # the convolutions' width
    channels_last: bool | None = None  # NHWC; auto: on with CUDA

    def validate(self):
        super().validate()
        require(self.base_channels >= 1, "base_channels must be at least 1")


class TinySegmenter(torch.nn.Module):
    def __init__(self, in_channels, num_classes, base_channels):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(in_channels, base_channels, 3, padding=1),
            torch.nn.BatchNorm2d(base_channels),
            torch.nn.ReLU(),
            torch.nn.Conv2d(base_channels, num_classes, 1),
        )

    def forward(self, x):
        return self.body(x)


def input_channels(cfg):
    return cfg.in_channels


def build_model(settings, cfg=None):
    model = TinySegmenter(**settings)
    return model.to(memory_format=torch.channels_last) if cfg and cfg.channels_last else model


def prepare_input(x, cfg):
    x = x.float() / 255
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x
'''
VOC_LIST_PAIRS = '''def list_pairs(cfg):
    """Pascal VOC's layout: JPEGImages/NAME.jpg with SegmentationClass/NAME.png, the names of
    each split in ImageSets/Segmentation/SPLIT.txt (--train_split train --val_split val)."""
    root = Path(cfg.dataset)

    def split(name):
        names = (root / "ImageSets" / "Segmentation" / f"{name}.txt").read_text().split()
        return [
            (root / "JPEGImages" / f"{n}.jpg", root / "SegmentationClass" / f"{n}.png", n)
            for n in names
        ]

    return split(cfg.train_split), split(cfg.val_split)
'''
# README "Make your own recipe" states these numbers: the lines that a copy of the U-Net with its
# own model and data changes (the imports of its model and data files), and a copy of its data
# file adapted to VOC's layout (list_pairs() and its helpers' import); its serving file changes 1.
UNET_CHANGED_LINES = 2
VOC_CHANGED_LINES = 36


def with_list_pairs(list_pairs):
    """unet_data.py with `list_pairs` for its own, and without the import of the helpers of the
    one it replaces (on a line of its own, marked ADAPT), as README says to adapt it."""
    data = (REPO / "recipes" / "unet_data.py").read_text()
    start = data.index("def list_pairs(")
    copy = data[:start] + list_pairs + data[data.index("\n\n\n", start) + 1 :]
    helpers = next(
        line for line in data.splitlines() if line.endswith("# ADAPT: with list_pairs()")
    )
    return copy.replace(helpers + "\n", "")


@pytest.mark.slow
def test_a_unet_copy_with_its_own_model_and_data_trains_on_1_and_2_processes_predicts_and_exports(
    shapes, tmp_path
):
    # The U-Net copied with its serving file (predict, export), its data file (VOC's layout in
    # list_pairs()) and a model file of its own, which takes only its own settings. Predict and
    # export take the copy's own model and data, and the adapted files leave no dead code behind:
    # they pass CI's lint.
    root = voc_layout(shapes, tmp_path / "voc")
    name = short_name()
    data = with_list_pairs(VOC_LIST_PAIRS)
    with copied_unet(name, data=data, model=TINY_MODEL) as (copy, changed):
        lint = subprocess.run(
            [BIN / "ruff", "check", *copy.parent.glob(f"{name}*.py")],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        args = [copy, "--dataset", root, "--val_split", "val", "--ignore_index", 255, *FAST]
        args += ["--base_channels", 8]
        train = [*args, "--smoke"]
        # On 2 processes; on 1, the grey copy below.
        two = launch([*train, "--output_dir", tmp_path / "two"], nproc=2, env=ONE_THREAD)
        assert_ok(two)
        weights = tmp_path / "two" / "model.safetensors"
        image = root / "JPEGImages" / "shape_0000.jpg"
        # --export runs the copy's serving file in its place; predict, that file's too, runs here.
        exported = launch([*args, "--export", "onnx", "--weights", weights], launcher="python")
        recipe = load_recipe(name)
        predict_here(recipe, weights, image, tmp_path / "masks")
        with pytest.raises(ConfigError, match="unknown setting 'encoder'"):  # the U-Net's went
            parse_config(recipe.Config, [str(a) for a in [*train[1:], "--encoder", "resnet18"]])
    assert changed["unet"] == UNET_CHANGED_LINES and changed["unet_predict"] == 1
    assert changed["unet_data"] == VOC_CHANGED_LINES
    assert lint.returncode == 0, lint.stdout
    assert "classes: mask values 0,1,2,3; ignored: 255" in two.output, two
    assert read_metrics(tmp_path / "two")[0]["eval_samples"] == 10
    assert read_record(weights, "segmentation")["model"] == {  # the copy's MODEL_SETTINGS
        "in_channels": 3,
        "num_classes": 4,
        "base_channels": 8,
    }
    with safe_open(weights, "pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"body"}  # the copy's model, not the U-Net
    mask = Image.open(tmp_path / "masks" / "shape_0000_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= {0, 1, 2, 3}
    assert_ok(exported)  # checked on the copy's own validation images
    assert f"(images of {root})" in exported.output, exported


GREY_LOSS = """\
    # Cross-entropy alone, class weights as given, ignored pixels left out; no focal term.
    ce = F.cross_entropy(logits.float(), target, weights, ignore_index=IGNORE, reduction="none")
    return ce.sum((1, 2)) / (target != IGNORE).sum((1, 2)).clamp(min=1)
"""
GREY_CHANGED_LINES = 22  # the loss's 21 lines, the model file's import


@pytest.mark.slow
def test_a_unet_copy_for_grey_images_with_its_own_loss_trains_and_predicts(shapes, tmp_path):
    # What a user with 1-channel images of 3 classes changes: the loss, in the copied recipe, and
    # the model's input channels by default, in the copied model file: every image is read grey,
    # even one saved as RGB.
    original = (REPO / RECIPE).read_text()
    start = original.index("\n", original.index("def loss_per_image(")) + 1  # its body
    source = original[:start] + GREY_LOSS + original[original.index("\n\n\n", start) + 1 :]
    model = (REPO / "recipes" / "unet_model.py").read_text()
    line = next(line for line in model.splitlines() if line.startswith("    in_channels: int = 0"))
    model = model.replace(line, "    in_channels: int = 1  # grey images")
    root = tmp_path / "grey"  # grey images, with one left in RGB, and 3 classes: 255 joins 170
    for folder in ("imgs", "masks"):
        (root / folder).mkdir(parents=True)
    for i, path in enumerate(sorted((shapes / "imgs").glob("*.png"))):
        Image.open(path).convert("RGB" if i == 5 else "L").save(root / "imgs" / path.name)
    for path in (shapes / "masks").glob("*.png"):
        mask = np.asarray(Image.open(path))
        merged = np.where(mask == 255, 170, mask).astype(np.uint8)
        Image.fromarray(merged).save(root / "masks" / path.name)
    name = short_name()
    with copied_unet(name, recipe=source, model=model) as (copy, changed):
        args = [copy, "--dataset", root, *FAST, "--base_channels", 8, "--smoke"]
        res = launch([*args, "--output_dir", tmp_path / "out"], launcher="python", env=ONE_THREAD)
        assert_ok(res)
        weights = tmp_path / "out" / "model.safetensors"
        image = shapes / "imgs" / "shape_0000.png"  # an RGB image, read in the weights' 1 channel
        predict_here(load_recipe(name), weights, image, tmp_path / "masks")
    assert changed == {"unet": GREY_CHANGED_LINES, "unet_predict": 1, "unet_model": 1}
    assert "; L images; " in res.output and "classes: mask values 0,85,170;" in res.output, res
    stored = read_trained(weights)
    assert stored["model"]["in_channels"] == 1 and stored["model"]["num_classes"] == 3
    mask = Image.open(tmp_path / "masks" / "shape_0000_mask.png")
    assert mask.size == (SIZE, SIZE) and set(np.unique(np.asarray(mask)).tolist()) <= {0, 85, 170}


CITYSCAPES_LIST_PAIRS = '''def list_pairs(cfg):
    """Cityscapes' layout: leftImg8bit/SPLIT/CITY/NAME_leftImg8bit.png with the label ids in
    gtFine/SPLIT/CITY/NAME_gtFine_labelIds.png (--train_split train --val_split val)."""
    root = Path(cfg.dataset)

    def split(name):
        pairs = []
        for image in sorted((root / "leftImg8bit" / name).glob("*/*_leftImg8bit.png")):
            labels = image.name.replace("leftImg8bit", "gtFine_labelIds")
            pairs.append((image, root / "gtFine" / name / image.parent.name / labels, image.name))
        return pairs

    return split(cfg.train_split), split(cfg.val_split)
'''

ADE20K_LIST_PAIRS = '''def list_pairs(cfg):
    """ADE20K's layout (ADEChallengeData2016): images/SPLIT/NAME.jpg with annotations/SPLIT/NAME.png
    (--train_split training --val_split validation)."""
    root = Path(cfg.dataset)

    def split(name):
        images = sorted((root / "images" / name).glob("*.jpg"))
        return [(p, root / "annotations" / name / f"{p.stem}.png", p.stem) for p in images]

    return split(cfg.train_split), split(cfg.val_split)
'''


def cityscapes_layout(shapes, root):
    """`shapes` in Cityscapes' layout, with its label ids: road 7, car 26, person 24, building
    11, and ego vehicle (1), which no class trains on, along the top."""
    ids = np.zeros(256, np.uint8)
    ids[[0, 85, 170, 255]] = [7, 26, 24, 11]
    for split, names in split_names(shapes).items():
        for folder in ("leftImg8bit", "gtFine"):
            (root / folder / split / "aachen").mkdir(parents=True)
        for name in names:
            image, values = image_and_mask(shapes, name)
            image.save(root / "leftImg8bit" / split / "aachen" / f"{name}_leftImg8bit.png")
            labels = ids[values]
            labels[:3] = 1
            Image.fromarray(labels).save(
                root / "gtFine" / split / "aachen" / f"{name}_gtFine_labelIds.png"
            )
    return root


def ade20k_layout(shapes, root):
    """`shapes` in ADE20K's layout: JPEG images, and masks where 0 is "other" (along the top)
    and the classes are 1.. (here 4 of them)."""
    for split, folder in (("train", "training"), ("val", "validation")):
        (root / "images" / folder).mkdir(parents=True)
        (root / "annotations" / folder).mkdir(parents=True)
        for name in split_names(shapes)[split]:
            image, values = image_and_mask(shapes, name)
            image.save(root / "images" / folder / f"{name}.jpg", quality=95)
            labels = (values // 85 + 1).astype(np.uint8)
            labels[:3] = 0
            Image.fromarray(labels).save(root / "annotations" / folder / f"{name}.png")
    return root


# (list_pairs() of the copy, the layout, its settings, what the start-up line says)
LAYOUTS = {
    "voc": (
        VOC_LIST_PAIRS,
        voc_layout,
        ["--val_split", "val", "--ignore_index", 255],
        "classes: mask values 0,1,2,3; ignored: 255",
    ),
    "cityscapes": (
        CITYSCAPES_LIST_PAIRS,
        cityscapes_layout,
        ["--val_split", "val", "--config", REPO / "recipes" / "configs" / "cityscapes.yaml"],
        "classes: mask values 7,8,11,12,13,17,19,20,21,22,23,24,... (19 in all) (road,sidewalk,"
        "building,wall,fence,pole,traffic light,traffic sign,vegetation,terrain,sky,person,... "
        "(19 in all)); ignored: every other value",
    ),
    "ade20k": (
        ADE20K_LIST_PAIRS,
        ade20k_layout,
        ["--train_split", "training", "--val_split", "validation", "--ignore_index", 0],
        "classes: mask values 1,2,3,4; ignored: 0",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_unet_copy_adapted_to_a_public_layout_changes_only_its_data_part(
    shapes, tmp_path, layout
):
    # The README's way to adapt the data to a layout the flags cannot name: copy the recipe, its
    # serving file and its data file, point their imports at each other, and rewrite list_pairs()
    # there, the part marked # ADAPT: your layout. docs/unet.md shows Cityscapes'. Each copy
    # differs from the recipe only in the pairs it lists and the classes its settings make,
    # which its load_data() shows in this process (the VOC copy trains, in the test above).
    from common.accelerator import build_accelerator

    list_pairs, make_layout, settings, classes = LAYOUTS[layout]
    root = make_layout(shapes, tmp_path / layout)
    name = short_name()
    with copied_unet(name, data=with_list_pairs(list_pairs)) as (_, changed):
        copy = load_recipe(name)
        cfg = parse_config(copy.Config, [str(a) for a in ["--dataset", root, *settings, *FAST]])
        data = copy.load_data(cfg, build_accelerator())
    assert changed["unet"] == 1 and changed["unet_predict"] == 1  # the imports, marked # ADAPT
    assert classes in str(data) and len(data.val_loader.dataset) == 10, data


@pytest.mark.slow
def test_copies_with_a_long_name_pass_the_lint_once_formatted(tmp_path):
    # README: copy the files, point the imports marked ADAPT at the copies, `make format`, then
    # `make lint` passes, for a name of up to LONG_NAME characters: the lines a copy renames keep
    # their comments short enough.
    name = (
        "my_" + "aerial_segmentation_of_farm_fields_and_roads_in_the_spring_rain"[: LONG_NAME - 3]
    )
    assert len(name) == LONG_NAME and name.isidentifier()
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    shutil.copytree(REPO / "common", tmp_path / "common")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    recipes = tmp_path / "recipes"
    renames = {  # a copy's file: the imports it points at its neighbours
        "unet": {"unet_model": f"{name}_model", "unet_data": f"{name}_data"},
        "unet_predict": {"unet": name},
        "unet_model": {},
        "unet_data": {},
    }
    for original, imports in renames.items():
        text = (recipes / f"{original}.py").read_text()
        for module, copy in imports.items():
            text = text.replace(f"\nfrom {module} import", f"\nfrom {copy} import")
        (recipes / f"{original.replace('unet', name)}.py").write_text(text)
    mnist = f"{name[:-4]}mnst"  # a classifier's copy, of the same length
    (recipes / f"{mnist}.py").write_text((recipes / "mnist.py").read_text())
    (recipes / f"{mnist}_predict.py").write_text(
        (recipes / "mnist_predict.py")
        .read_text()
        .replace("\nfrom mnist import", f"\nfrom {mnist} import")
    )
    ruff = str(BIN / "ruff")
    for command in (["format", "."], ["check", "--fix", "."]):  # make format
        subprocess.run([ruff, *command], cwd=tmp_path, capture_output=True, check=False)
    for command in (["format", "--check", "."], ["check", "."]):  # make lint
        res = subprocess.run([ruff, *command], cwd=tmp_path, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr


LONG_NAME = 59  # README, Make your own recipe: a copy's name of up to this many characters
