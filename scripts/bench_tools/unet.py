"""The U-Net variants, each built from recipes/unet.py (its Config, model, make_optimizer, loss,
augmentation, load_data and train_one_epoch) and recipes/unet_data.py (list_pairs); and its
loader alone."""

import dataclasses
import itertools
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import set_seed
from PIL import Image
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader, Dataset

from bench_tools import load_recipe, recipe_config
from bench_tools.flops import flops_per_sample
from bench_tools.loops import bound_rep, classic_rep, last_batches, recipe_rep
from common.data import worker_count
from common.determinism import set_deterministic
from common.progress import Progress
from common.schedule import fit_cosine
from unet_data import list_pairs


class ClassicSegmentation(Dataset):
    """What milesial/Pytorch-UNet's BasicDataset does per sample: open the image and the mask with
    PIL, convert both with numpy (the image to float CHW in [0, 1], the mask values to class indices
    in a loop over the values), then make tensors. Like it, no augmentation."""

    def __init__(self, pairs, values):
        self.pairs = pairs  # [(image path, mask path, name)]
        self.values = values  # the mask value of each class

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        image_path, mask_path, _ = self.pairs[i]
        img = np.asarray(Image.open(image_path).convert("RGB")).transpose((2, 0, 1)) / 255.0
        values = np.asarray(Image.open(mask_path))
        mask = np.zeros(values.shape, dtype=np.int64)
        for c, v in enumerate(self.values):
            mask[values == v] = c
        return (
            torch.as_tensor(img.copy()).float().contiguous(),
            torch.as_tensor(mask.copy()).long().contiguous(),
        )


def make_scheduler(unet, optimizer, cfg, progress, steps_per_epoch):
    """The schedule main() makes (recipes/unet.py has no function for it): the one cfg.scheduler
    names, a cosine (or held cosine) to 0 at the run's last optimizer step (fit_cosine)."""
    scheduler = unet.SCHEDULERS[cfg.scheduler](optimizer)
    if isinstance(scheduler, CosineAnnealingLR):
        fit_cosine(scheduler, cfg, progress, steps_per_epoch=steps_per_epoch)
    return scheduler


def bench_unet(args, accelerator):
    """Set up the U-Net variants, as bench_mnist does."""
    unet = load_recipe("unet")
    device = accelerator.device
    sizes = [
        f
        for k in ("image_size", "batch_size")
        if getattr(args, k) is not None
        for f in (f"--{k}", str(getattr(args, k)))
    ]
    cfg = recipe_config(unet, args, *sizes)
    set_deterministic(cfg.deterministic, benchmark=not cfg.bucket_by_size)  # as main() does
    if not (Path(cfg.dataset) / "imgs").is_dir():
        raise SystemExit(
            f"error: the U-Net bench needs a folder with imgs/ and masks/ (the "
            f"classic loop opens the files), not {cfg.dataset}"
        )
    # The recipe's own data path, as its main() builds it on one process.
    cfg, data, _ = unet.settle(cfg, accelerator)  # channels_last auto, the classes, ...
    weights = unet.class_weights(cfg, data.class_pixels, device)
    train_loader, values = data.train_loader, data.values
    train_source, _ = list_pairs(cfg)  # the image and mask files, for the classic loop
    workers = worker_count(cfg.num_workers, 1)  # the recipe's when it does not cache
    train_set = train_loader.dataset
    epoch_steps, sizes = last_batches(train_loader, args.steps, cfg.dataset, at_most=args.quick)
    steps = len(sizes)
    lr = cfg.scaled_lr(accelerator.num_processes)

    def new_model(cfg=cfg, tutorial=False):
        set_seed(cfg.seed)  # the same initial weights in every variant
        settings = {name: getattr(cfg, name) for name in unet.MODEL_SETTINGS}
        model = unet.build_model(settings, cfg)  # as main() builds it
        if tutorial:  # the recipe's AdamW settings, with the foreach kernels that milesial asks for
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=lr, weight_decay=cfg.weight_decay, foreach=True
            )
        else:
            optimizer = unet.make_optimizer(model, lr, cfg, accelerator)
        return model, optimizer

    def step(model, optimizer, x, y):
        """The recipe's training step with nothing around it: loss, backward, clipping, AdamW."""
        loss = unet.compute_loss(model(x), y, cfg, weights).mean()
        accelerator.backward(loss)
        if cfg.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()

    def setup_recipe(cfg=cfg, compile_model=False):
        model, optimizer = new_model(cfg)
        model, optimizer, loader = accelerator.prepare(model, optimizer, train_loader)
        if compile_model:  # what prepare() does with dynamo_backend INDUCTOR in the config
            model = torch.compile(model)
        progress = Progress(accelerator, cfg, metric="dice")
        scheduler = make_scheduler(
            unet, optimizer, cfg, progress, math.ceil(len(loader) / cfg.gradient_accumulation_steps)
        )

        def train_epoch(epoch_loader):
            return unet.train_one_epoch(
                model,
                epoch_loader,
                optimizer,
                scheduler=scheduler,
                accelerator=accelerator,
                cfg=cfg,
                progress=progress,
                ema=None,
                classes=data.classes,
                weights=weights,
            )

        return recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch)

    def setup_bound():
        model, optimizer = new_model()
        model, optimizer = accelerator.prepare(model, optimizer)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
        batches, start = [], 0
        for n in sizes:  # the recipe's samples, flips included, as float images on the device
            x, y, rand = train_set.__getitems__(order[start : start + n].tolist())
            x, y = unet.augment(x, y, rand, cfg)
            start += n
            batches.append((unet.prepare_input(x.to(device), cfg), y.to(device)))
        return bound_rep(model, batches, lambda x, y: step(model, optimizer, x, y))

    def setup_classic(workers):
        def setup():
            model, optimizer = new_model(tutorial=True)
            model, optimizer = accelerator.prepare(model, optimizer)
            dataset = ClassicSegmentation(train_source, values)
            # The tutorial pins memory; only a GPU has it (on a CPU, torch warns and ignores it).
            loader = DataLoader(
                dataset,
                batch_size=cfg.batch_size,
                shuffle=True,
                num_workers=workers,
                pin_memory=device.type == "cuda",
            )

            return classic_rep(
                model, loader, steps, device, lambda x, y: step(model, optimizer, x, y)
            )

        return setup

    x, y = unet.augment(*train_set.__getitems__([0]), cfg)  # as the model sees it: resized, cropped
    x, y = x[0], y[0]
    preset = ["--config", args.config] if args.config else []
    info = {
        "dataset": cfg.dataset,
        "config": args.config,
        "settings": dataclasses.asdict(cfg),  # as main() settles them (unet.settle)
        "train_samples": len(train_set),
        "batch_size": cfg.batch_size,
        "input_size": list(x.shape[1:]),
        "flops_per_sample": flops_per_sample(
            lambda: unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS}),
            x,
            y,
            lambda logits, y: unet.loss_per_image(logits, y, num_classes=cfg.num_classes).mean(),
        ),
        "steps_per_rep": steps,
        "samples_per_rep": sum(sizes),
        "steps_per_epoch": epoch_steps,
        "model": f"UNet(base_channels={cfg.base_channels})",
        "optimizer": f"AdamW(lr={lr:g}, weight_decay={cfg.weight_decay}), gradient norm clipped "
        f"to {cfg.grad_clip}, scheduler {cfg.scheduler}; recipe and bound: "
        f"make_optimizer (fused kernels, except under fp16); classic: foreach kernels",
        "recipe_loop": f"recipes/unet.py load_data ({data.reading}) + recipes/unet.py "
        f"train_one_epoch",
        "startup_cmd": [
            sys.executable,
            "recipes/unet.py",
            "--dataset",
            cfg.dataset,
            *preset,
            "--smoke",
            "--smoke_steps",
            "1",
        ],
        "startup_marker": "unet: ",  # main() prints this line after data, model and prepare()
        "what": {
            "recipe": "recipe's make_loaders + train_one_epoch",
            "bound": "float batches already on the device",
            "classic_w0": "PIL -> numpy -> tensor per sample, DataLoader num_workers 0",
            f"classic_w{workers}": f"the same with num_workers {workers}, as the recipe streams "
            f"with",
        },
    }
    variants = {
        "recipe": setup_recipe,
        "bound": setup_bound,
        "classic_w0": setup_classic(0),
        f"classic_w{workers}": setup_classic(workers),
    }
    if "channels_last" in args.also:
        info["what"]["recipe_cl"] = "the recipe with --channels_last true (model and batches NHWC)"
        variants["recipe_cl"] = lambda: setup_recipe(dataclasses.replace(cfg, channels_last=True))
    if "compile" in args.also:
        info["what"]["recipe_compile"] = (
            "the recipe, model compiled (torch.compile, inductor) after prepare()"
        )
        variants["recipe_compile"] = lambda: setup_recipe(compile_model=True)
    return info, variants


def bench_loader(args, accelerator):
    """The U-Net's data path alone: one variant per --loader entry (recipe flags over the
    defaults), each rep() one epoch of the training loader, prepared as main() prepares it, with
    nothing done to the batches. rep.setup_s: seconds to build it (decoding, if it caches);
    rep.data: its description, as the recipe's start-up line gives it."""
    unet = load_recipe("unet")
    variants = {}

    def setup(flags):
        cfg = recipe_config(unet, args, *shlex.split(flags))
        start = time.perf_counter()
        _, data, _ = unet.settle(cfg, accelerator)  # copy_paste auto among what it settles
        loader = accelerator.prepare(data.train_loader)
        epochs = itertools.count()

        def rep():
            epoch = next(epochs)
            loader.set_epoch(epoch)
            loader.dataset.epoch = epoch
            images = 0
            for batch in loader:  # images, masks and the augmentation's random numbers
                images += len(batch[1])
            return images

        rep.setup_s = round(time.perf_counter() - start, 3)
        rep.data = str(data)
        return rep

    for flags in args.loader:
        variants[flags or "defaults"] = lambda flags=flags: setup(flags)
    return variants
