"""Launched by test_gpu.py on one GPU: does fetching a training batch ever make Python wait for
the GPU? For the U-Net, its augmentation of each batch too (crop and flips, per sample).

A blocking copy from the CPU to the GPU (or an .item()) waits until the GPU has run all the work
queued before it, so the GPU then idles while the next batch is fetched. With
torch.cuda.set_sync_debug_mode("error") every such wait raises. The loaders are the recipes'
own, prepared as their main() prepares them.

    python tests/sync_probe.py MNIST_DIR SHAPES_DIR
"""

import itertools
import sys

import torch
from recipe_module import load_recipe  # first: it puts the repository on sys.path

from common.accelerator import build_accelerator, close

mnist_dir, shapes_dir = sys.argv[1:3]
mnist, unet = load_recipe("mnist"), load_recipe("unet")
accelerator = build_accelerator()
device = accelerator.device
assert device.type == "cuda", device

loaders = {}
for on_device in (True, False):
    cfg = mnist.Config(dataset=mnist_dir, data_on_device=on_device, batch_size=32)
    train_loader = mnist.make_loaders(cfg, device)[0]
    loaders[f"mnist data_on_device {on_device}"] = accelerator.prepare(train_loader)
# As the recipe's main() builds them.
for bucketed, cache in itertools.product((False, True), (True, False)):
    cfg = unet.Config(
        dataset=shapes_dir,
        batch_size=4,
        crop_size=32,
        num_workers=2,
        bucket_by_size=bucketed,
        cache_images=cache,
        hflip=0.5,  # as settle() makes auto on data with no mirror twins
        vflip=0.5,
    )
    data = unet.load_data(cfg, accelerator)
    # Bucketed loaders are sharded and placed by common/sampler.py; the others go through prepare().
    train_loader = data.train_loader if bucketed else accelerator.prepare(data.train_loader)
    loaders[f"unet cache_images {cache}" + " bucket_by_size" * bucketed] = train_loader

for name, loader in loaders.items():
    for epoch in (1, 2):  # the second epoch: persistent workers, a reshuffled order
        loader.set_epoch(epoch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            batches = [batch for batch in loader]
            if name.startswith("unet"):  # as train_one_epoch augments them
                batches = [unet.augment(*batch, cfg) for batch in batches]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(t.device.type == "cuda" for batch in batches for t in batch), name
    print(f"{name}: {len(batches)} batches, no wait for the GPU", flush=True)
del loaders, loader, batches, data, train_loader
close(accelerator)
