"""What only a GPU can show; skipped on a machine without one."""

import pytest
import torch
import yaml
from conftest import REPO, assert_ok, launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fetching_a_training_batch_never_waits_for_the_gpu(tiny_mnist, shapes):
    res = launch(["tests/sync_probe.py", tiny_mnist, shapes], launcher="python")
    assert_ok(res)
    assert res.output.count("no wait for the GPU") == 6, res  # 2 MNIST, 4 U-Net loaders


@pytest.mark.parametrize(
    "precision, optimizer", [("no", "fused AdamW"), ("bf16", "fused AdamW"), ("fp16", "; AdamW")]
)
def test_the_unet_adamw_is_fused_except_under_the_fp16_gradient_scaler(
    shapes, tmp_path, precision, optimizer
):
    config = yaml.safe_load((REPO / "accelerate_configs" / "1gpu.yaml").read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**config, "mixed_precision": precision}))
    res = launch(
        [
            "recipes/unet.py",
            "--dataset",
            shapes,
            "--output_dir",
            tmp_path / "out",
            "--smoke",
            "--base_channels",
            8,
        ],
        config=tmp_path / "config.yaml",
    )
    assert_ok(res)
    assert f"{optimizer} lr" in res.output, res
