"""The labels of the datasets users bring, as the U-Net reads them: Pascal VOC's void (255),
Cityscapes' label ids, ADE20K's 150 classes (and more), colour masks, and the one-line errors of
masks that lost their values to JPEG or interpolation. In-process (load_data, as main() calls
it), but for the colour masks' training and predict launch."""

import re

import numpy as np
import pytest
import torch
from conftest import (
    FAST,
    N_IMAGES,
    ONE_THREAD,
    REPO,
    SIZE,
    VAL_FRACTION,
    assert_ok,
    launch,
    predict_here,
    relabelled,
    with_void,
)
from PIL import Image

from common.config import parse_config
from common.data import DataError
from common.segmentation.data import IGNORE
from common.segmentation.metrics import confusion_counts

RECIPE = "recipes/unet.py"


def load(unet, root, *args):
    """load_data() of the recipe with these command-line settings."""
    from common.accelerator import build_accelerator

    base = ["--dataset", root, "--val_fraction", VAL_FRACTION, "--num_workers", 0]
    cfg = parse_config(unet.Config, [str(a) for a in [*base, *args]])
    return unet.load_data(cfg, build_accelerator())


def all_masks(loader):
    return torch.cat([batch[1] for batch in loader])


def test_ignore_index_takes_voc_void_out_of_the_classes_the_loss_and_the_metrics(
    unet, shapes, tmp_path
):
    root = relabelled(shapes, tmp_path / "voc", with_void, count=30)
    # Without the setting, 255 is a class, and the start-up says that it looks like a void label.
    data = load(unet, root)
    assert data.values == [0, 1, 2, 3, 255]
    assert any("--ignore_index 255 leaves its pixels out" in note for note in data.notes)
    data = load(unet, root, "--ignore_index", 255, "--cache_images", "false")
    assert data.values == [0, 1, 2, 3] and data.num_classes == 4 and not data.notes
    assert "; ignored: 255" in str(data)
    # Each void pixel arrives as IGNORE, the others as their classes: here decoded at every read,
    # and cached, where 255 in a uint8 mask stands for IGNORE.
    files = [np.asarray(Image.open(mask)) for _, mask, _ in data.train_loader.dataset.pairs.listed]
    expected = np.bincount(np.concatenate([m.ravel() for m in files]), minlength=256)
    for masks in (
        all_masks(data.train_loader),
        all_masks(load(unet, root, "--ignore_index", 255).train_loader),
    ):
        assert (masks == IGNORE).sum() == expected[255] > 0
        assert torch.bincount(masks[masks != IGNORE]).tolist() == expected[:4].tolist()
    y = masks[:4]
    # Whatever the model says on void pixels changes neither the loss nor the metrics.
    torch.manual_seed(0)
    logits = torch.randn(len(y), 4, *y.shape[1:])
    changed = torch.where((y == IGNORE)[:, None], 100 * torch.randn_like(logits), logits)
    for a, b in zip(
        (unet.loss_per_image(logits, y, num_classes=4), confusion_counts(logits, y, 4)),
        (unet.loss_per_image(changed, y, num_classes=4), confusion_counts(changed, y, 4)),
    ):
        assert torch.equal(a, b)
    assert confusion_counts(logits, y, 4).sum() == (y != IGNORE).sum()


@pytest.mark.slow
def test_cityscapes_ids_become_its_19_classes_through_the_preset(unet, shapes, tmp_path):
    # Label ids as Cityscapes stores them: road 7, building 11, person 24, car 26; and ids that
    # no class trains on, ego vehicle 1 and static 4.
    ids = {0: 7, 85: 26, 170: 24, 255: 11}

    def cityscapes(values, i):
        out = np.vectorize(ids.get)(values).astype(np.uint8)
        out[:3] = 1 if i % 2 else 4
        return out

    root = relabelled(shapes, tmp_path / "cityscapes", cityscapes, count=30)
    cityscapes = REPO / "recipes" / "configs" / "cityscapes.yaml"
    data = load(unet, root, "--config", cityscapes)
    assert data.num_classes == 19 and data.values[:3] == [7, 8, 11]
    assert "ignored: every other value" in str(data)
    masks = all_masks(data.val_loader)
    assert set(masks.unique().tolist()) <= {IGNORE, 0, 2, 11, 13}  # road, building, person, car
    assert (masks[:, :3] == IGNORE).all() and (masks[:, 3:] != IGNORE).all()
    # Without ignore_unlisted, the first id that is no class is named, with the settings.
    with pytest.raises(DataError) as e:
        load(unet, root, "--config", cityscapes, "--ignore_unlisted", "no")
    assert re.search(r"has value [14], which is not one of mask_values 7,8,11,", str(e.value))
    assert "list the value in --mask_values, or leave it out with --ignore_index" in str(e.value)


def regions(count, values, block=16, seed=0, dtype=np.uint8):
    """Masks of SIZE x SIZE made of block x block regions, each of one value: every value fills
    whole regions, in several masks."""
    rng = np.random.default_rng(seed)
    side = SIZE // block
    pool = np.resize(rng.permutation(values), count * side * side)  # each value, many times
    rng.shuffle(pool)
    return [
        np.kron(
            pool[i * side * side : (i + 1) * side * side].reshape(side, side),
            np.ones((block, block)),
        ).astype(dtype)
        for i in range(count)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("values", [151, 300], ids=["ADE20K's 151 values", "300 values, 16 bit"])
def test_many_classes_are_inferred_from_masks_that_fill_regions(unet, shapes, tmp_path, values):
    dtype = np.uint8 if values <= 256 else np.uint16
    masks = regions(N_IMAGES, np.arange(values), block=8, dtype=dtype)
    root = relabelled(shapes, tmp_path / "many", lambda _, i: masks[i])
    data = load(unet, root)
    assert data.num_classes == values and data.values == list(range(values))
    got = all_masks(data.val_loader)
    assert got.max() < values and got.min() >= 0
    # Stored as uint8 up to 255 classes (255 then stands for ignored), past that as int32.
    stored = data.train_loader.dataset.cache[1].dtype
    assert stored == (torch.uint8 if values <= 255 else torch.int32)
    # ADE20K's reduce_zero_label: 0 ("other") ignored, 150 classes.
    if values == 151:
        data = load(unet, root, "--ignore_index", 0)
        assert data.num_classes == 150 and data.values == list(range(1, 151))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["jpeg", "bilinear"])
def test_masks_that_lost_their_values_say_the_likely_cause(unet, shapes, tmp_path, how):
    def lossy(values, i):
        mask = Image.fromarray(values)
        if how == "bilinear":  # made larger, then smaller, with interpolation
            return mask.resize((2 * SIZE, 2 * SIZE), Image.BILINEAR).resize(
                (SIZE, SIZE), Image.BILINEAR
            )
        return mask

    root = relabelled(shapes, tmp_path / how, lossy, suffix=".jpg" if how == "jpeg" else ".png")
    with pytest.raises(DataError) as e:
        load(unet, root)
    message = str(e.value)
    cause = "as resizing with interpolation or saving as JPEG leaves them"
    assert f"lie only along the edges between others, {cause}" in message
    assert "save the masks as PNG, resized by nearest neighbour" in message and "\n" not in message


CAMVID = {
    0: (0, 0, 0),
    85: (128, 64, 128),
    170: (64, 0, 128),
    255: (128, 128, 0),
}  # void, road, car, sign


def coloured(values, i):
    rgb = np.zeros((*values.shape, 3), np.uint8)
    for value, colour in CAMVID.items():
        rgb[values == value] = colour
    return rgb


@pytest.mark.slow
def test_colour_masks_train_and_predict_in_their_colours(unet, shapes, tmp_path):
    root = relabelled(shapes, tmp_path / "camvid", coloured)
    out = tmp_path / "out"
    res = launch(
        [RECIPE, "--dataset", root, "--output_dir", out, "--smoke", *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "classes: mask colours #000000,#400080,#804080,#808000;" in res.output, res
    predict_here(
        unet, out / "model.safetensors", root / "imgs" / "shape_000*.png", tmp_path / "predicted"
    )
    predicted = sorted((tmp_path / "predicted").glob("*_mask.png"))
    assert len(predicted) == 10
    for path in predicted:
        mask = Image.open(path)
        assert mask.mode == "RGB" and mask.size == (SIZE, SIZE)
        colours = {tuple(c) for c in np.asarray(mask).reshape(-1, 3).tolist()}
        assert colours <= set(CAMVID.values()), colours
    # Colours listed in class order, and one of them ignored (CamVid's void, black).
    data = load(unet, root, "--mask_values", "#000000,#804080,#400080,#808000")
    assert data.values == [0x000000, 0x804080, 0x400080, 0x808000]
    data = load(unet, root, "--ignore_index", "#000000")
    assert data.num_classes == 3 and "; ignored: #000000" in str(data)
    assert (all_masks(data.val_loader) == IGNORE).any()


@pytest.mark.slow
def test_colour_and_grey_masks_together_are_named(unet, shapes, tmp_path):
    root = relabelled(
        shapes, tmp_path / "mixed", lambda v, i: coloured(v, i) if i == 3 else v, count=20
    )
    with pytest.raises(
        DataError,
        match="is in colour, mask .* holds grey levels or palette indices: save all masks alike",
    ):
        load(unet, root)


@pytest.mark.slow
def test_settings_and_masks_that_do_not_fit_the_classes_are_one_line(unet, shapes, tmp_path):
    for args, message in [
        (["--ignore_unlisted", "true"], "ignore_unlisted needs --mask_values: the values that are"),
        (
            ["--mask_values", "0,85,170,255", "--ignore_index", 255],
            "mask value 255 is both a class (mask_values) and ignored (ignore_index)",
        ),
    ]:
        with pytest.raises(DataError, match=re.escape(message)) as e:
            load(unet, shapes, *args)
        assert "\n" not in str(e.value)

    def floats(values, i):  # a mask of floating-point values, as TIFF keeps them
        return Image.fromarray(values.astype(np.float32))

    root = relabelled(shapes, tmp_path / "floats", floats, count=20, suffix=".tif")
    with pytest.raises(DataError, match="holds float32 values: save one integer value per class"):
        load(unet, root)
