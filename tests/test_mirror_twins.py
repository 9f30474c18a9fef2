"""Classes that a horizontal flip turns into each other (a brain atlas's left and right regions)
are found in the masks, and hflip auto is then 0: flipping would teach the model that a left
region is a right one. Classes that a mirror changes but that lie anywhere (digits, shapes)
and classes in the middle are no twins, and hflip auto stays 0.5."""

import subprocess
import sys
from dataclasses import replace

import torch
from conftest import REPO, make_shapes

from common.accelerator import build_accelerator
from common.config import parse_config

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
    cfg = unet.resolved(cfg, data, CPU)
    # make_atlas.py gives a left region value 2k + 1 and its right twin 2k + 2; value v is class v
    assert data.values == list(range(21))
    assert data.twins == [(2 * k + 1, 2 * k + 2) for k in range(9)]
    assert cfg.hflip == 0
    note = unet.twins_note(data, None)
    assert note.startswith("note: classes 1/2, 3/4, 5/6, 7/8, 9/10, 11/12 ... (9 pairs) are")
    assert "hflip is 0 (auto" in note
    asked = unet.resolved(replace(cfg, hflip=0.5), data, CPU)
    assert asked.hflip == 0.5  # as asked: the note says what it does
    assert "--hflip 0.5 turns one into the other" in unet.twins_note(data, 0.5)


def test_shapes_that_lie_anywhere_are_no_twins_and_hflip_auto_is_half(unet, tmp_path):
    shapes = make_shapes(tmp_path / "shapes", 60, 48, "--colours", "random", "--clutter", "2")
    cfg, data = loaded(unet, ["--dataset", shapes, "--output_dir", tmp_path])
    cfg = unet.resolved(cfg, data, CPU)
    assert data.twins == [] and cfg.hflip == 0.5
    assert unet.twins_note(data, None) is None
