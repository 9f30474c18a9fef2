"""Pairing images with masks by name is linear in the number of files: every U-Net start in
every process pairs them, and a quadratic pairing took minutes at Carvana's 5,088 images.

The work is counted, not timed: the Python and C calls that folder_pairs() makes (sys.setprofile
sees each), for N and 4N pairs. Linear work grows about 4 times; matching every image's pattern
against every mask name (as before) grows 16 times."""

import json
import sys

import numpy as np
import pytest
from conftest import assert_ok, launch
from PIL import Image

from common.segmentation.pairs import folder_pairs


def write_pairs(folder, count, mask_suffix):
    (folder / "imgs").mkdir(parents=True)
    (folder / "masks").mkdir()
    pixels = np.zeros((4, 4), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "one.png")
    data = (folder / "one.png").read_bytes()
    for i in range(count):
        (folder / "imgs" / f"img_{i:04d}.png").write_bytes(data)
        (folder / "masks" / f"img_{i:04d}{mask_suffix}").write_bytes(data)


def calls_to_pair(folder, mask_name):
    count = 0

    def counter(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(counter)
    try:
        pairs = folder_pairs(folder / "imgs", folder / "masks", mask_name=mask_name)
    finally:
        sys.setprofile(None)
    return count, pairs


@pytest.mark.parametrize(
    "mask_name, suffix",
    [("", "_mask.png"), ("{stem}_mask.*", "_mask.gif"), ("{stem}_L.png", "_L.png")],
)
def test_pairing_does_work_linear_in_the_number_of_pairs(tmp_path, mask_name, suffix):
    small, large = 100, 400
    write_pairs(tmp_path / "small", small, suffix)
    write_pairs(tmp_path / "large", large, suffix)
    calls_small, pairs_small = calls_to_pair(tmp_path / "small", mask_name)
    calls_large, pairs_large = calls_to_pair(tmp_path / "large", mask_name)
    assert len(pairs_small) == small and len(pairs_large) == large
    assert pairs_large[7][1].name == f"img_0007{suffix}"
    growth = calls_large / calls_small
    assert growth < 5, f"{calls_small} calls for {small} pairs, {calls_large} for {large}"


def test_a_stem_is_taken_as_it_is_not_as_a_glob(tmp_path):
    """An image named with glob characters finds its own mask, not another's."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "masks").mkdir()
    Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / "one.png")
    data = (tmp_path / "one.png").read_bytes()
    for stem in ("scan[1]", "scan1", "a.b"):
        (tmp_path / "imgs" / f"{stem}.png").write_bytes(data)
        (tmp_path / "masks" / f"{stem}_mask.png").write_bytes(data)
    pairs = folder_pairs(tmp_path / "imgs", tmp_path / "masks")
    assert {p[0].stem: p[1].name for p in pairs} == {
        "scan[1]": "scan[1]_mask.png",
        "scan1": "scan1_mask.png",
        "a.b": "a.b_mask.png",
    }


@pytest.mark.slow
def test_two_processes_pair_once_and_fail_alike(tmp_path):
    """from_main_process (the U-Net's pairing): the main process alone computes, every process
    gets its result, and its error is raised on both ranks, so neither waits for the other."""
    res = launch(["tests/main_process_probe.py"], nproc=2, env={"PROBE_OUT": str(tmp_path)})
    assert_ok(res)
    assert (tmp_path / "ran.txt").read_text() == "0\n"
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in seen:
        assert report["result"] == {"pairs": [["a.png", "a_mask.png"]], "by": 0}
        assert report["error"] == "a.png has no mask (seen on rank 0)"
