"""Launched by test_mnist.py with 2 processes: which training samples does each rank get?

    accelerate launch ... tests/shard_probe.py --dataset DIR --batch_size 16 --seed 1 2 1

For each seed in turn (the recipe's --seed; more after it), it builds the loaders with the
recipe's own make_loaders() and build_accelerator(), prepares them as the recipe does, and
writes the sample ids (encoded in two pixels) seen per epoch to $PROBE_OUT/rank{N}.json:
[{epoch: ids} for each seed].
"""

import json
import os
import sys
from pathlib import Path

from recipe_module import load_recipe  # first: it puts the repository on sys.path

from common.accelerator import build_accelerator, close
from common.config import parse_config

mnist = load_recipe("mnist")

at = sys.argv.index("--seed")
seeds = [int(s) for s in sys.argv[at + 1 :]]
runs = []
for seed in seeds:
    cfg = parse_config(mnist.Config, [*sys.argv[1:at], "--seed", str(seed)])
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
    runs.append(seen)
    del train_loader
out = Path(os.environ["PROBE_OUT"])
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(runs))
close(accelerator)
