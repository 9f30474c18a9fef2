"""Classes that a horizontal flip turns into each other (a brain atlas's left and right regions)
are found in the masks, and hflip auto is then 0: flipping would teach the model that a left
region is a right one. Classes that lie anywhere (shapes, digits) and classes in the middle are
no twins. Classes whose shapes lean one way, as digits and letters do, are found too (their
mean shape against its mirror image), and hflip auto is then 0, since a flip would teach shapes
that the data never holds, and zoom auto 0.25 in the flips' place; shapes that come in both
mirror images keep hflip auto at 0.5 and zoom auto at 0. copy_paste auto pastes objects on a
background, and none in an atlas of twins."""

import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch
from conftest import REPO, make_shapes
from PIL import Image

import unet_rules
from common.accelerator import build_accelerator
from common.config import parse_config
from common.segmentation.data import SHAPE_GRID, shape_sums

CPU = torch.device("cpu")


def make_atlas(root, count, regions, size=64):
    subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "make_atlas.py",
            *map(str, ("--out", root, "--count", count, "--regions", regions, "--size", size)),
        ],
        check=True,
        capture_output=True,
    )
    return root


def loaded(unet, args):
    """(cfg, the recipe's data) of these arguments, the images left undecoded (no cache)."""
    more = ["--num_workers", 0, "--cache_images", "false", "--cache_decoded", "false"]
    cfg = parse_config(unet.Config, [str(a) for a in [*args, *more]])
    return cfg, unet.load_data(cfg, build_accelerator())


def test_left_right_twins_are_found_and_hflip_auto_is_0(unet, tmp_path):
    atlas = make_atlas(tmp_path / "atlas", 40, 20)  # 9 left/right pairs, 2 regions on the midline
    args = ["--images", atlas / "imgs", "--masks", atlas / "masks", "--output_dir", tmp_path]
    cfg, data = loaded(unet, args)
    cfg = unet_rules.resolved(cfg, data, CPU)
    # make_atlas.py gives a left region value 2k + 1 and its right twin 2k + 2; value v is class v
    assert data.values == list(range(21))
    assert data.twins == [(2 * k + 1, 2 * k + 2) for k in range(9)]
    assert cfg.hflip == 0 and cfg.copy_paste == 0  # each region where it belongs: none pasted
    note = unet_rules.twins_note(data, None)
    assert note.startswith("note: classes 1/2, 3/4, 5/6, 7/8, 9/10, 11/12 ... (9 pairs) are")
    assert "hflip is 0 (auto" in note
    asked = unet_rules.resolved(replace(cfg, hflip=0.5), data, CPU)
    assert asked.hflip == 0.5  # as asked: the note says what it does
    assert "--hflip 0.5 turns one into the other" in unet_rules.twins_note(data, 0.5)


def test_shapes_that_lie_anywhere_are_no_twins_and_hflip_auto_is_half(unet, tmp_path):
    shapes = make_shapes(tmp_path / "shapes", 60, 48, "--colours", "random", "--clutter", "2")
    cfg, data = loaded(unet, ["--dataset", shapes, "--output_dir", tmp_path])
    cfg = unet_rules.resolved(cfg, data, CPU)
    assert data.twins == [] and cfg.hflip == 0.5
    assert unet_rules.twins_note(data, None) is None


def test_copy_paste_auto_pastes_objects_on_a_background_and_not_a_scene_or_an_atlas(unet):
    # Classes' training pixels, the background class 0: half or more of them, objects on it.
    def auto(pixels, twins=()):
        data = SimpleNamespace(class_pixels=pixels, background=0, twins=list(twins))
        return unet_rules.on_a_background(data)

    assert auto([92, 4, 4]) and auto([50, 30, 20])  # digits on clutter; half exactly
    assert not auto([35, 30, 20, 15])  # a street: the road the most, buildings, sky, cars
    assert not auto([60, 20, 20], twins=[(1, 2)])  # an atlas: each region where it belongs


# Letters drawn in masks as classes 1 to 4: L, F and P lean one way, T is its own mirror image.
LETTERS = [
    ["X....", "X....", "X....", "X....", "XXXX."],
    ["XXXX.", "X....", "XXX..", "X....", "X...."],
    ["XXX..", "X..X.", "XXX..", "X....", "X...."],
    ["XXXXX", "..X..", "..X..", "..X..", "..X.."],
]


def make_letters(root, count, mirrored_too, size=48, seed=0):
    """count pairs in root/imgs and root/masks: noise images, each mask 3 of LETTERS at random
    places and sizes (class k + 1 where letter k is); mirrored_too: each letter mirrored or not
    at random."""
    rng = np.random.default_rng(seed)
    (root / "imgs").mkdir(parents=True)
    (root / "masks").mkdir()
    for n in range(count):
        mask = np.zeros((size, size), np.uint8)
        for k in rng.choice(len(LETTERS), 3, replace=False):
            glyph = np.array([[c == "X" for c in row] for row in LETTERS[k]])
            glyph = glyph[:, ::-1] if mirrored_too and rng.random() < 0.5 else glyph
            glyph = glyph.repeat(rng.integers(3, 5), 0).repeat(rng.integers(3, 5), 1)
            top, left = (
                rng.integers(0, size - glyph.shape[0]),
                rng.integers(0, size - glyph.shape[1]),
            )
            mask[top : top + glyph.shape[0], left : left + glyph.shape[1]][glyph] = k + 1
        image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(image).save(root / "imgs" / f"{n:03d}.png")
        Image.fromarray(mask).save(root / "masks" / f"{n:03d}.png")
    return root


def test_shapes_that_lean_one_way_are_found_and_hflip_auto_is_0_and_zoom_and_copy_paste_on(
    unet, tmp_path
):
    letters = make_letters(tmp_path / "letters", 240, mirrored_too=False)
    args = ["--images", letters / "imgs", "--masks", letters / "masks", "--output_dir", tmp_path]
    cfg, data = loaded(unet, args)
    assert data.values == [0, 1, 2, 3, 4] and data.twins == []
    assert [i for i, _ in data.mirrored] == [1, 2, 3]  # L, F and P; T is its own mirror image
    assert all(difference >= 0.15 for _, difference in data.mirrored)
    settled = unet_rules.resolved(cfg, data, CPU)
    assert (settled.hflip, settled.zoom, settled.copy_paste) == (0, 0.25, 0.5)
    assert unet_rules.augmentation_note(settled) == (
        "augmentation: zoom 0.25, copy_paste 0.5 (each off at 0); past the image's edges: "
        "mirrored (--fill zeros: black)"
    )
    assert unet_rules.augmentation_note(replace(settled, fill="zeros")).endswith(
        "edges: black (--fill reflect: mirrored)"
    )
    note = unet_rules.mirrored_note(data, cfg)
    assert note.startswith("note: classes 1, 2, 3 have shapes that a mirror changes")
    assert note.endswith(
        "hflip is 0 (auto; --hflip 0.5 flips anyway), and zoom is 0.25 in the flips' place "
        "(auto; --zoom 0 turns it off)"
    )
    bucketed = replace(cfg, bucket_by_size=True)  # images of their own sizes: none to paste
    assert unet_rules.resolved(bucketed, data, CPU).copy_paste == 0
    asked = replace(cfg, hflip=0.5, zoom=0.0, copy_paste=0.0)
    assert "leave hflip at auto" in unet_rules.mirrored_note(data, asked)
    assert "zoom" not in unet_rules.mirrored_note(data, asked)
    settled = unet_rules.resolved(asked, data, CPU)
    assert (settled.hflip, settled.zoom, settled.copy_paste) == (0.5, 0, 0)  # as asked
    assert unet_rules.augmentation_note(settled) == "augmentation: hflip 0.5 (each off at 0)"


def test_shapes_in_both_mirror_images_keep_hflip_auto_at_half_and_zoom_off(unet, tmp_path):
    letters = make_letters(tmp_path / "letters", 240, mirrored_too=True)
    args = ["--images", letters / "imgs", "--masks", letters / "masks", "--output_dir", tmp_path]
    cfg, data = loaded(unet, args)
    settled = unet_rules.resolved(cfg, data, CPU)
    assert data.mirrored == [] and (settled.hflip, settled.zoom) == (0.5, 0)
    assert settled.copy_paste == 0.5  # letters on a background: copy_paste auto is on
    assert (
        unet_rules.augmentation_note(settled)
        == "augmentation: hflip 0.5, copy_paste 0.5 (each off at 0)"
    )
    assert unet_rules.mirrored_note(data, cfg) is None


def test_a_mirrored_mask_has_each_class_shape_mirrored_and_a_full_box_fills_every_cell():
    rng = np.random.default_rng(0)
    # sizes read whole, and one over SHAPE_SIDE (300) read on samples (mirror_samples)
    for height, width in [(5, 7), (31, 48), (96, 96), (100, 37), (300, 200)]:
        mask = rng.integers(0, 4, (height // 4 + 1, width // 4 + 1)).repeat(4, 0).repeat(4, 1)
        mask = mask[:height, :width].astype(np.uint8)
        shapes, mirrored = shape_sums(mask), shape_sums(mask[:, ::-1].copy())
        assert shapes.keys() == mirrored.keys()
        for v, cells in shapes.items():
            grid = cells.reshape(SHAPE_GRID, SHAPE_GRID)
            assert np.array_equal(mirrored[v].reshape(SHAPE_GRID, SHAPE_GRID), grid[:, ::-1])
    box = np.zeros((40, 50), np.int32)  # not uint8: the np.unique path
    box[3:30, 10:43] = 7
    assert np.array_equal(shape_sums(box)[7], np.ones(SHAPE_GRID * SHAPE_GRID))
