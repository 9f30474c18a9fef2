"""Launched by test_global_batch.py on 1 or 2 processes: which images make each optimizer step
of the U-Net's training loader, two epochs long?

    python tests/step_probe.py --dataset DIR --global_batch_size 8 ...   # the recipe's settings

It splits the global batch, builds the accelerator and the loaders as the recipe's main() does,
and counts optimizer steps as its loop does (accelerator.accumulate, sync_gradients). An image is
known by its row of augmentation random numbers, which are seeded by (seed, epoch, image). Each
rank writes $PROBE_OUT/rank{N}.json: per epoch, per optimizer step, the image ids of each of its
batches.
"""

import json
import os
from pathlib import Path

import torch
from recipe_module import load_recipe  # first: it puts the repository on sys.path

from common.accelerator import build_accelerator, close, launched_processes
from common.config import parse_config

unet = load_recipe("unet")

cfg = parse_config(unet.Config).split_global_batch(launched_processes())
accelerator = build_accelerator(
    gradient_accumulation_steps=cfg.gradient_accumulation_steps, seed=cfg.seed
)
data = unet.load_data(cfg, accelerator)
train_loader = data.train_loader  # bucketed loaders come sharded (and placed): as main()
if not cfg.bucket_by_size:
    train_loader = accelerator.prepare(train_loader)
dataset = train_loader.dataset
seen = {}
for epoch in (1, 2):
    dataset.epoch = epoch
    train_loader.set_epoch(epoch)
    every = dataset.randoms(range(len(dataset)))  # row i: image i's random numbers this epoch
    steps, batches = [], []
    for _, _, rand in train_loader:
        with accelerator.accumulate():
            ids = [int(torch.argmin((every - row.cpu()).abs().sum(1))) for row in rand]
            assert all(torch.equal(every[i], row.cpu()) for i, row in zip(ids, rand))
            batches.append(ids)
        if accelerator.sync_gradients:
            steps.append(batches)
            batches = []
    assert not batches, "an epoch ends with an optimizer step"
    seen[epoch] = steps
out = Path(os.environ["PROBE_OUT"])
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(seen))
del train_loader, data, dataset
close(accelerator)
