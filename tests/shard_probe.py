"""Launched by test_mnist.py with 2 processes: which training samples does each rank get?

It builds the loaders with the recipe's own make_loaders() and build_accelerator(), prepares
them as the recipe does, and writes the sample ids (encoded in two pixels) seen per epoch.
"""

import json
import os
from pathlib import Path

from recipe_module import load_recipe  # first: it puts the repository on sys.path

from common.accelerator import build_accelerator, close
from common.config import parse_config

mnist = load_recipe("mnist")

cfg = parse_config(mnist.Config)
accelerator = build_accelerator(
    gradient_accumulation_steps=cfg.gradient_accumulation_steps, seed=cfg.seed
)
train_loader, _ = mnist.make_loaders(cfg)
train_loader = accelerator.prepare(train_loader)
seen = {}
for epoch in (1, 2):
    train_loader.set_epoch(epoch)
    ids = []
    for x, _ in train_loader:
        x = x.cpu().long()
        ids += (x[:, 0, 0, 0] + 256 * x[:, 0, 0, 1]).tolist()
    seen[epoch] = ids
out = Path(os.environ["PROBE_OUT"])
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
del train_loader
close(accelerator)
