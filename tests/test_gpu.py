"""What only a GPU can show; skipped on a machine without one."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_ok, launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fetching_a_training_batch_never_waits_for_the_gpu(tiny_mnist, tmp_path):
    shapes = tmp_path / "shapes"
    subprocess.run([sys.executable, REPO / "scripts" / "make_shapes.py", "--out", shapes, "--count", "24",
                    "--size", "48"], check=True, capture_output=True)
    res = launch(["tests/sync_probe.py", tiny_mnist, shapes], launcher="python")
    assert_ok(res)
    assert res.output.count("no wait for the GPU") == 4, res
