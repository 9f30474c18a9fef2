"""scripts/bench.py's FLOP count, against counts done by hand and the figure of issue 18."""

import importlib.util

import pytest
import torch

from conftest import REPO
from recipe_module import load_recipe


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_flops_per_sample_counts_forward_and_backward_of_one_sample():
    bench = load_bench()
    # Linear 4 -> 3: forward 2 x 4 x 3 per sample; backward the weight gradient only (the input
    # needs none), 2 x 4 x 3 again.
    flops = bench.flops_per_sample(lambda: torch.nn.Linear(4, 3), torch.zeros(4), torch.zeros(3),
                                   lambda out, y: ((out - y) ** 2).mean())
    assert flops == 48
    # The default U-Net (64 base channels, 4 classes) on 256x256: 288.9 GFLOP, as counted on the
    # H100 for issue 18.
    unet = load_recipe("unet")
    cfg = unet.Config(num_classes=4, in_channels=3)
    flops = bench.flops_per_sample(
        lambda: unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS}),
        torch.zeros(3, 256, 256, dtype=torch.uint8), torch.zeros(256, 256, dtype=torch.long),
        lambda logits, y: unet.loss_per_image(logits, y, cfg.num_classes).mean())
    assert round(flops / 1e9, 1) == 288.9
