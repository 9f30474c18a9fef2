"""scripts/studies/name_digits.py, the classifier that docs/learning.md holds the U-Net's naming
of the digits against: it crops every digit of the recipe's split, trains, and reports each
epoch."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ONE_THREAD, REPO, make_digits
from PIL import Image

from common.segmentation.pairs import folder_splits


@pytest.mark.slow
def test_name_digits_crops_each_digit_of_the_recipes_split_and_reports_every_epoch(tmp_path):
    data = make_digits(
        tmp_path / "digits",
        *("--colours", "random", "--digit_size", "0.46,0.625", "--band", "2"),
        *("--size", "48", "--count", "30"),
    )
    res = subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "studies" / "name_digits.py",
            *("--dataset", data, "--size", "48", "--base_channels", "4", "--epochs", "2"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    # A digit is a class of a mask, neither background (0) nor void (255), in the split that
    # the recipe makes of these images (10% held out: 3 of 30).
    train, val = folder_splits(data / "imgs", data / "masks")
    assert len(val) == 3

    def count(pairs):
        return sum(len(set(np.unique(np.asarray(Image.open(m)))) - {0, 255}) for _, m, _ in pairs)

    lines = res.stdout.splitlines()
    assert f"{count(train)} training and {count(val)} held-out digits" in lines[0]
    named = [
        re.fullmatch(r"epoch (\d+): held-out digits named right ([0-9.]+)", x) for x in lines[1:]
    ]
    assert [int(m[1]) for m in named] == [1, 2]
    assert all(0 <= float(m[2]) <= 1 for m in named)
