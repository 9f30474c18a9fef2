"""Your own data by flags, with no copy of the recipe: the layouts users bring most after VOC
(the Oxford-IIIT Pet, ISIC 2018, CamVid, Kaggle's Carvana, and VOC's own folders), each named by
the first error with the flags that read it, then read, trained, predicted and resumed with them;
class names through to the start-up line, metrics.jsonl, predict and the overlays in the
dataset's colours; the data check (--check_data); and MNIST's classes taken from its data."""

import csv
import re
import subprocess

import numpy as np
import pytest
import torch
from conftest import (
    ONE_THREAD,
    assert_ok,
    launch,
    predict_here,
    read_metrics,
)
from layouts import (
    CAMVID_CLASSES,
    camvid_layout,
    carvana_layout,
    flags_of,
    isic_layout,
    pet_layout,
    voc_layout,
)
from PIL import Image
from recipe_module import load_recipe

from common.accelerator import build_accelerator
from common.checkpoint import read_record
from common.config import ConfigError, parse_config
from common.data import DataError
from common.segmentation.data import read_class_names, void_notes
from common.segmentation.panels import paint
from unet_data import list_pairs

RECIPE = "recipes/unet.py"
TINY = ["--base_channels", 8, "--num_workers", 0, "--eval_batch_size", 4, "--batch_size", 4]

# layout -> (its builder, the flags its first error names after --images ROOT/, training and
# validation images)
LAYOUTS = {
    "pet": (
        pet_layout,
        "images --masks {root}/annotations/trimaps --train_list {root}/annotations/trainval.txt "
        "--val_list {root}/annotations/test.txt",
        (63, 10),
    ),
    "isic": (
        isic_layout,
        "ISIC2018_Task1-2_Training_Input --masks {root}/ISIC2018_Task1_Training_GroundTruth "
        "--mask_name '{{stem}}_segmentation.png' --val_images "
        "{root}/ISIC2018_Task1-2_Validation_Input --val_masks "
        "{root}/ISIC2018_Task1_Validation_GroundTruth",
        (63, 10),
    ),
    "camvid": (
        camvid_layout,
        "train --masks {root}/train_labels --mask_name '{{stem}}_L.png' --val_images {root}/val "
        "--val_masks {root}/val_labels --class_names {root}/class_dict.csv --ignore_index Void",
        (58, 10),
    ),
    "carvana": (carvana_layout, "train --masks {root}/train_masks", (66, 7)),
    "voc": (
        lambda shapes, root: voc_layout(shapes, root, extra=12),
        "JPEGImages --masks {root}/SegmentationClass --train_list "
        "{root}/ImageSets/Segmentation/train.txt --val_list {root}/ImageSets/Segmentation/val.txt",
        (63, 10),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_error_names_the_layout_and_the_flags_that_read_it(
    unet, shapes, tmp_path, layout
):
    build, flags, (n_train, n_val) = LAYOUTS[layout]
    root = build(shapes, tmp_path / layout)
    # What a new user types first: --dataset at the folder. The error names what it holds and
    # the flags that fit; never the parquet columns of a datasets folder.
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    message = str(error.value)
    assert message.startswith(f"{root} is neither imgs/ with masks/ nor parquet files: it holds ")
    assert message.endswith(f"read it with --images {root}/{flags.format(root=root)}"), message
    assert "column" not in message and "parquet files train" not in message
    # Those flags read it: each image with its own mask, the splits as the layout has them.
    train, val = list_pairs(parse_config(unet.Config, flags_of(message)))
    assert (len(train), len(val)) == (n_train, n_val)
    stems = [image.stem for image, _, _ in train + val]
    assert len(set(stems)) == n_train + n_val
    for image, mask, _ in train + val:
        assert mask.name.startswith(image.stem) and mask.suffix != ".jpg"


def test_an_image_without_a_mask_says_how_the_masks_there_are_named(unet, shapes, tmp_path):
    root = isic_layout(shapes, tmp_path / "isic")
    images, masks = (
        root / "ISIC2018_Task1-2_Training_Input",
        root / "ISIC2018_Task1_Training_GroundTruth",
    )
    cfg = parse_config(unet.Config, ["--images", str(images), "--masks", str(masks)])
    with pytest.raises(DataError) as error:
        list_pairs(cfg)
    assert str(error.value) == (
        f"{images}/ISIC_0000000.jpg has no mask: looked for {masks}/ISIC_0000000.* or "
        f"{masks}/ISIC_0000000_mask.*; the masks there are named like "
        f"ISIC_0000000_segmentation.png: --mask_name '{{stem}}_segmentation.png'"
    )
    # A glob of images works as a folder does; a list that names an image not there is named.
    glob = parse_config(
        unet.Config,
        [
            "--images",
            f"{images}/*.jpg",
            "--masks",
            str(masks),
            "--mask_name",
            "{stem}_segmentation.png",
        ],
    )
    assert len(list_pairs(glob)[0]) + len(list_pairs(glob)[1]) == 63
    (tmp_path / "val.txt").write_text("ISIC_0000001\nISIC_9999999\n")
    with pytest.raises(DataError, match=re.escape("such as 'ISIC_9999999', have no image")):
        list_pairs(
            parse_config(
                unet.Config, [*map(str, glob_args(glob)), "--val_list", str(tmp_path / "val.txt")]
            )
        )


def glob_args(cfg):
    return ["--images", cfg.images, "--masks", cfg.masks, "--mask_name", cfg.mask_name]


def test_class_names_are_a_list_or_a_file_and_name_what_is_ignored(tmp_path):
    assert read_class_names("road,car,sky") == (("road", "car", "sky"), None)
    assert read_class_names("pet=1,background=2") == (("pet", "background"), (1, 2))
    table = tmp_path / "class_dict.csv"
    table.write_text("name,r,g,b\nSky,128,128,128\nVoid,0,0,0\n")
    assert read_class_names(str(table)) == (("Sky", "Void"), (0x808080, 0))
    for text, message in [
        ("a,a", "must give distinct names"),
        ("a=1,b", "must give every class a distinct mask value"),
        (str(tmp_path / "none.csv"), "does not exist"),
    ]:
        with pytest.raises(ConfigError, match=message):
            read_class_names(text)


def test_a_camvid_layout_trains_on_2_processes_with_its_class_names_and_colours(
    unet, camvid_two_processes, tmp_path
):
    # The shared run (conftest): the flags CamVid's first error names, and Void, a class of
    # class_dict.csv, left out by its name. test_unet_training.py resumes it.
    run = camvid_two_processes
    root, out, res = run.root, run.out, run.res
    names = ["Animal", "Building", "Car", "Pole", "Sky"]
    assert (
        "classes: mask colours #408040,#800000,#400080,#c0c080,#808080 "
        "(Animal,Building,Car,Pole,Sky); ignored: #000000;" in res.output
    ), res
    assert (
        "dice: per image, the mean over those of classes Animal, Building, Car, Pole in its mask "
        "or prediction; background: Sky (the most pixels;" in res.output
    ), res
    row = read_metrics(out)[-1]
    assert list(row["iou_per_class"]) == names and list(row["dice_per_class"]) == names
    assert row["iou_per_class"]["Animal"] in (None, 0.0)  # in no mask
    record = read_record(out / "model.safetensors", "segmentation")
    assert record["class_names"] == names and record["background"] == 4
    assert record["colours"] == [list(CAMVID_CLASSES[n]) for n in names]
    # Predict writes the masks in the dataset's colours, and paints its overlays in them too.
    image = root / "val" / "shape_0063.png"
    predict_here(unet, out / "model.safetensors", image, tmp_path / "p", "--overlay")
    mask = np.asarray(Image.open(tmp_path / "p" / "shape_0063_mask.png").convert("RGB"))
    colours = {tuple(c) for c in mask.reshape(-1, 3).tolist()}
    assert colours <= {CAMVID_CLASSES[n] for n in names}, colours
    painted = np.asarray(Image.open(tmp_path / "p" / "shape_0063_overlay.png"), np.int32)
    rgb = np.asarray(Image.open(image).convert("RGB"), np.int32)
    sky = (mask == CAMVID_CLASSES["Sky"]).all(-1)
    assert (painted[sky] == rgb[sky]).all()  # the background is left as it is
    for name in names[:-1]:
        where = (mask == CAMVID_CLASSES[name]).all(-1)
        expected = (rgb[where] + np.array(CAMVID_CLASSES[name])) // 2
        assert (np.abs(painted[where] - expected) <= 1).all(), name


@pytest.mark.slow
def test_a_void_class_of_class_dict_is_named_in_the_notes_and_suggestions_paste_into_bash(
    unet, shapes, tmp_path
):
    # Where class_dict.csv gives the classes with their colours, Void among them, a run without
    # --ignore_index trains Void as a class: the notes say so by its name (the masks' void along
    # their top rows is no band between the others: its name gives it away).
    root = camvid_layout(shapes, tmp_path / "my data" / "camvid")  # a space in the path
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    flags = flags_of(error.value)
    assert flags[-4:] == ["--class_names", str(root / "class_dict.csv"), "--ignore_index", "Void"]
    data = unet.load_data(
        parse_config(unet.Config, [*flags[:-2], "--num_workers", "0"]), build_accelerator()
    )
    assert data.names[-1] == "Void" and data.notes == [
        "note: mask value #000000 (Void) is named as a void label is, and is a class of its own "
        "now: --ignore_index Void leaves its pixels out of the loss and the metrics"
    ]
    # A suggested flag survives a paste into bash: a path with a space, a colour (# starts a
    # comment there), a mask name with braces.
    pasted = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {str(error.value).split('read it with ')[1]}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert pasted.stdout.splitlines() == flags and "{stem}_L.png" in flags
    found = {  # value: masks, a mask, pixels, interior pixels, training pixels, edges
        0x000000: [9, "a.png", 300, 0, 250, 100],  # a thin band on every edge between values
        0x800000: [9, "a.png", 5000, 4000, 4000, 50],
        0x008000: [9, "a.png", 5000, 4000, 4000, 50],
    }
    (note,) = void_notes(found, list(found), colour=True)
    suggested = note.split("now: ")[1].split(" leaves")[0]
    pasted = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {suggested}"], capture_output=True, text=True, check=True
    )
    assert pasted.stdout.splitlines() == ["--ignore_index", "#000000"], note


def test_check_data_prints_the_classes_and_notes_and_draws_them_without_training(
    unet, shapes, tmp_path, capsys
):
    # The serving file's check_data() in the test process, as `--check_data` runs it in the
    # recipe's place (launched: test_check_data_is_launched_in_the_recipes_place, slow).
    root = pet_layout(shapes, tmp_path / "pet")
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    out = tmp_path / "check"
    args = [*flags_of(error.value), "--check_data", "--num_workers", 0, "--output_dir", out]
    load_recipe("unet_predict").check_data(
        parse_config(unet.Config, [str(a) for a in args]), build_accelerator()
    )
    lines = capsys.readouterr().out.splitlines()
    res = "\n".join(lines)
    table = lines[lines.index(next(x for x in lines if x.startswith("class "))) :][:4]
    assert [row.split()[:2] for row in table[1:]] == [["0", "1"], ["1", "2"], ["2", "3"]], table
    shares = [float(row.split()[2].rstrip("%")) for row in table[1:]]
    assert abs(sum(shares) - 100) < 0.05 and shares[1] == max(shares), table
    # Each class is in every mask: 63 of the training split, which the header names (the
    # validation masks are 10 more).
    assert table[0].endswith("training pixels  training masks"), table
    assert [row.split()[-1] for row in table[1:]] == ["63"] * 3, table
    # The trimap's border (3) lies between pet and background: the note that VOC's void gets.
    assert (
        "note: mask value 3 lies along the edges between the others (on 100% of them), as a void "
        "or unlabelled band does, and is a class of its own now: --ignore_index 3 leaves its "
        "pixels out of the loss and the metrics" in lines
    ), res
    # The background is the class of the most pixels (value 2), not class 0 (value 1, the pet).
    assert any(
        x.startswith("dice: per image, the mean over those of classes 1, 3 in its mask")
        and x.endswith("background: 2 (the most pixels; --background changes it)")
        for x in lines
    ), res
    sheet = Image.open(out / "data_check.png")
    assert sheet.width == 3 * 48 and sheet.height > 8 * (48 + 4)  # 8 rows: image | overlay | mask
    # Under them, the key: each class's colour beside its index and mask value.
    key = np.asarray(sheet)[8 * (48 + 4) :].reshape(-1, 3)
    painted = paint(torch.arange(3)).tolist()
    assert all((key == colour).all(1).any() for colour in painted), painted
    assert sorted(p.name for p in out.iterdir()) == ["data_check.png"]  # nothing trained
    # The images as they are: copy-paste, which pastes as training reads them, draws nothing.
    pasting = [*args[:-1], tmp_path / "pasting", "--copy_paste", 1]
    load_recipe("unet_predict").check_data(
        parse_config(unet.Config, [str(a) for a in pasting]), build_accelerator()
    )
    assert "augmentation: hflip 0.5, copy_paste 1 (each off at 0)" in capsys.readouterr().out
    drawn = np.asarray(Image.open(tmp_path / "pasting" / "data_check.png"))
    assert np.array_equal(drawn, np.asarray(sheet))
    # With the border ignored and the pet named, dice is the pet's.
    data = unet.load_data(
        parse_config(
            unet.Config,
            [*flags_of(error.value), "--ignore_index", "3", "--class_names", "pet,background"],
        ),
        build_accelerator(),
    )
    assert data.names == ["pet", "background"] and data.background == 1 and not data.notes
    assert unet.dice_classes(data.num_classes, data.background) == [0]


@pytest.mark.slow
def test_check_data_is_launched_in_the_recipes_place(unet, shapes, tmp_path):
    # `python recipes/unet.py --check_data` hands over to the serving file: the data check's
    # table and picture, nothing trained.
    root = pet_layout(shapes, tmp_path / "pet")
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    out = tmp_path / "check"
    args = [*flags_of(error.value), "--check_data", "--num_workers", 0, "--output_dir", out]
    res = launch([RECIPE, *args], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    assert "unet data check: RGB images;" in res.output, res
    assert "training pixels  training masks" in res.output, res
    assert sorted(p.name for p in out.iterdir()) == ["data_check.png"]  # nothing trained


def test_check_data_stops_with_the_errors_of_training(unet, shapes, tmp_path):
    root = pet_layout(shapes, tmp_path / "pet")
    bad = root / "annotations" / "trimaps" / "beagle_0000.png"
    Image.fromarray(np.full((48, 47), 1, np.uint8)).save(bad)
    args = ["--images", root / "images", "--masks", root / "annotations" / "trimaps"]
    cfg = parse_config(
        unet.Config, [*map(str, args), "--check_data", "--output_dir", str(tmp_path)]
    )
    message = f"mask {bad} is 47x48, its image 48x48"
    for step in (load_recipe("unet_predict").check_data, unet.load_data):
        with pytest.raises(DataError, match=re.escape(message)):
            step(cfg, build_accelerator())


def digit_folders(tiny_mnist, root, names=("cat", "dog", "emu")):
    """An imagefolder of 3 classes, train/NAME/*.png and test/NAME/*.png, from tiny_mnist's
    digits 0, 1 and 2: the classes are the folders' names."""
    import pyarrow.parquet as pq

    for split, count in (("train", 60), ("test", 12)):
        table = pq.read_table(tiny_mnist / f"{'train' if split == 'train' else 'test'}.parquet")
        images, labels = table["image"].to_pylist(), table["label"].to_pylist()
        seen = {}
        for image, label in zip(images, labels):
            if label < len(names) and seen.get(label, 0) < count // len(names):
                folder = root / split / names[label]
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{seen.setdefault(label, 0):03d}.png").write_bytes(image["bytes"])
                seen[label] += 1
    return root


def test_mnist_takes_its_classes_from_the_data_and_predicts_their_names(
    tiny_mnist, tmp_path, monkeypatch
):
    data = digit_folders(tiny_mnist, tmp_path / "animals")
    out = tmp_path / "out"
    res = launch(
        ["recipes/mnist.py", "--dataset", data, "--smoke", "--batch_size", 8, "--output_dir", out],
        launcher="python",
    )
    assert_ok(res)
    assert "60 train / 12 test samples of 3 classes" in res.output, res
    assert read_record(out / "model.safetensors", "classes") == ["cat", "dog", "emu"]
    mnist, serving = load_recipe("mnist"), load_recipe("mnist_predict")
    weights = out / "model.safetensors"
    cfg = parse_config(  # predict's own settings are the serving file's
        serving.ServingConfig,
        ["--predict", str(data / "test" / "*" / "*.png"), "--weights", str(weights)]
        + ["--predict_csv", str(tmp_path / "p.csv"), "--top_k", "2"],
    )
    classes = read_record(cfg.weights, "classes")
    model = mnist.BasicNet(num_classes=len(classes))
    serving.predict(cfg, build_accelerator(), model, classes)
    with open(tmp_path / "p.csv", newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header == ["file", "label", "probability", "label_2", "probability_2"]
    assert len(rows) == 12 and {r[1] for r in rows} | {r[3] for r in rows} <= {"cat", "dog", "emu"}
    with pytest.raises(Exception, match="top_k 4 is more than the model's 3 classes"):
        serving.predict(
            parse_config(
                serving.ServingConfig, ["--predict", "x", "--weights", str(weights), "--top_k", "4"]
            ),
            build_accelerator(),
            model,
            classes,
        )
    # The data check: each class's samples in each split, and the picture, of every class in
    # turn (the folder lists them class by class).
    drawn = []
    monkeypatch.setattr(serving, "save_labelled", lambda x, labels, path: drawn.extend(labels))
    serving.check_data(
        parse_config(mnist.Config, ["--dataset", str(data), "--output_dir", str(tmp_path / "c")]),
        build_accelerator(),
    )
    assert drawn == ["cat", "dog", "emu"] * 10 + ["cat", "dog"], drawn


@pytest.mark.slow
def test_the_pet_layout_trains_resumes_and_predicts_with_the_flags_alone(unet, shapes, tmp_path):
    root = pet_layout(shapes, tmp_path / "pet")
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    args = [RECIPE, *flags_of(error.value), *TINY, "--output_dir", tmp_path / "out"]
    # Stopped at step 4 of the first epoch, then resumed: mid-epoch.
    first = launch([*args, "--epochs", 1, "--max_steps", 4], launcher="python", env=ONE_THREAD)
    assert_ok(first)
    res = launch([*args, "--epochs", 1, "--resume", "latest"], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    assert "resumed from" in res.output and "(epoch 1, step 4)" in res.output, res
    (row,) = read_metrics(tmp_path / "out")
    assert row["eval_samples"] == LAYOUTS["pet"][2][1]
    _, val = list_pairs(parse_config(unet.Config, flags_of(error.value)))
    image = val[0][0]
    predict_here(unet, tmp_path / "out" / "model.safetensors", image, tmp_path / "p")
    predicted = Image.open(tmp_path / "p" / f"{image.stem}_mask.png")
    assert predicted.size == Image.open(val[0][1]).size
    record = read_record(tmp_path / "out" / "model.safetensors", "segmentation")
    assert set(np.unique(np.asarray(predicted)).tolist()) <= set(record["mask_values"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, values",
    [("isic", [0, 255]), ("carvana", [0, 1]), ("voc", [0, 1, 2, 3, 255])],
    ids=["isic", "carvana", "voc"],
)
def test_each_layout_reads_as_training_reads_it_with_the_flags_alone(
    unet, shapes, tmp_path, layout, values
):
    # Their JPEG images, and masks of 0/255 (ISIC), GIF (Carvana) and VOC's palette PNGs (the void
    # band a class until --ignore_index 255 leaves it out, as its note says): every batch of the
    # recipe's loaders, as its training and evaluation read them. What they then train and predict
    # with is the recipe's, as for the Pet's above.
    build, _, (_, n_val) = LAYOUTS[layout]
    root = build(shapes, tmp_path / layout)
    with pytest.raises(DataError) as error:
        list_pairs(unet.Config(dataset=str(root)))
    cfg = parse_config(unet.Config, [*flags_of(error.value), *map(str, TINY)])
    data = unet.load_data(cfg, build_accelerator())
    assert data.values == values and len(data.val_loader.dataset) == n_val, data
    for loader in (data.train_loader, data.val_loader):
        for x, y, *_ in loader:
            assert x.dtype == torch.uint8 and x.shape[1] == 3 and x.shape[2:] == y.shape[1:]
            assert 0 <= y.min() and y.max() < len(values)


def test_dice_counts_only_the_classes_an_image_holds_or_is_predicted_to_hold(unet):
    # A model that predicts background alone, on an image with a circle (class 1) and on an
    # empty one: the first scores 0 (its circle missed; the absent classes 2 and 3 are no
    # success), the second 1 (nothing to find, nothing found). Before: 0.67 and 1.
    import torch

    class Background(torch.nn.Module):
        def forward(self, x):
            logits = torch.zeros(len(x), 4, *x.shape[2:])
            logits[:, 0] = 1
            return logits

    masks = torch.zeros(2, 32, 32, dtype=torch.long)
    masks[0, 8:16, 8:16] = 1
    batch = (torch.zeros(2, 3, 32, 32, dtype=torch.uint8), masks)
    cfg = parse_config(unet.Config, ["--num_classes", "4"])
    result = unet.evaluate(
        Background(), [batch], build_accelerator(), cfg, flips="", weights=None, background=0
    )
    assert result["dice"] == pytest.approx(0.5)
    assert result["dice_per_class"] == {
        "0": pytest.approx(2 * 1984 / (2 * 1984 + 64)),
        "1": 0.0,
        "2": None,
        "3": None,
    }
