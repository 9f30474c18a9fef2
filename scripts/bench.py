"""How close a recipe's training loop runs to the compute bound, and to the classic tutorial loop.

    python scripts/bench.py                          # MNIST on data/mnist_sample, CPU or first GPU
    python scripts/bench.py --reps 7 --json runs/bench/cpu.json
    python scripts/bench.py --dataset ylecun/mnist --steps 300   # full MNIST (hub or local cache)
    python scripts/bench.py --recipe unet            # U-Net on data/shapes: 6 minutes, 2 CPU cores
    python scripts/bench.py --recipe unet --also channels_last compile   # and the recipe with these
    python scripts/bench.py --recipe unet --dataset DIR --image_size 256 --batch_size 32  # real
    python scripts/bench.py --recipe unet --loader "" "--num_workers 4"  # the data path, no model
    accelerate launch --config_file accelerate_configs/bf16.yaml --num_processes 1 scripts/bench.py

One process trains the same model (the recipe's own class, optimizer settings, batch size and
the precision of the accelerate config) in three ways:

- recipe:  the recipe as users run it: its make_loaders(), prepared by the Accelerator that
           common.runtime.build_accelerator() builds, and its own train_one_epoch().
- bound:   the same training step on batches that are already normalised floats on the device,
           a fixed list cycled: the compute bound, with no data path at all.
- classic: the tutorial loop on the same data, a few workers or none; the faster is compared.
           MNIST (pytorch/examples mnist): a Dataset that makes a PIL image per sample, ToTensor
           and Normalize per sample, a default DataLoader (shuffle, batch 64), `.to(device)` per
           batch; 0 and 1 workers. U-Net (milesial/Pytorch-UNet): a Dataset that opens the image
           and mask files with PIL per sample and converts them with numpy, a DataLoader with
           pin_memory, `.to(device, dtype)` per batch; 0 workers and the recipe's num_workers.
           Its AdamW uses the foreach kernels, as milesial's optimizer does; the recipe's and the
           bound's use the fused ones (recipes/unet.py make_optimizer).

A repetition is `--steps` optimizer steps (default: one full epoch of the train split, so the
recipe runs exactly as in training: no max_steps, hence no checkpoint inside the timed part).
After `--warmup` repetitions of each, the variants take turns in rounds (recipe, bound, classic;
then bound, classic, recipe; ...) so that noise from other work on the machine hits all of them
alike. Reported: the median and the best repetition of each (on a busy machine the best is the
least disturbed one), and the median of the per-round ratios.
All share one torch thread count (`--threads`). Then the recipe is launched `--startup_runs`
times as a subprocess to time its start-up.

`--startup_cache` (MNIST) times only the start-up, from the end of the imports to the first
training step, on a datasets cache that starts empty: the first launch (the decoded images are
written to the cache), the second (they are read from it), and the second with
`--cache_decoded false` (decoded again, as before the cache).

`--also` (U-Net) adds the recipe with its `channels_last` setting and/or with the model
compiled as the accelerate config's `dynamo_backend: INDUCTOR` compiles it (torch.compile after
prepare()), to the same rounds; the report gives each one's speed over the plain recipe's.
Compiling happens in the warm-up repetition.

The U-Net bench also reports FLOP/s. The FLOPs of training on one sample are counted once, at
start (torch.utils.flop_counter, one forward and backward at the run's image size); each
variant's samples/s times that is its TFLOP/s, and its fraction of the peak is that over the
TFLOP/s of a large square matrix product in the run's precision (fp32, or the accelerate
config's bf16/fp16), timed before and after the rounds (the higher counts). `--image_size` and
`--batch_size` set the recipe's sizes: data from `scripts/make_shapes.py --size 256` at
`--image_size 256 --batch_size 32` is training as it looks on a GPU.
`--loader FLAGS...` (U-Net) measures the data path alone instead: the images/s that the recipe's
training loader yields, built by load_data() and prepared as main() prepares it, with no model;
one variant per FLAGS, recipe settings over the defaults ("" for the defaults), in the same
interleaved rounds of whole epochs, after one warm-up epoch (which starts the workers).

Prints a table and writes JSON (default runs/bench/<recipe>.json). Not a test: the figures depend
on the machine. Adding a recipe: write a `bench_<name>(args, accelerator)` like bench_mnist and
add it to RECIPES with its defaults.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "recipes")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torchvision import transforms  # noqa: E402

from common.config import UserError, parse_config  # noqa: E402
from common.determinism import set_deterministic  # noqa: E402
from common.metrics import peak_memory_mb  # noqa: E402
from common.progress import Progress  # noqa: E402
from common.data import worker_count  # noqa: E402
from unet_data import load_data, open_sources  # noqa: E402
from common.runtime import build_accelerator, close  # noqa: E402
from recipe_module import load_recipe  # noqa: E402  (tests/recipe_module.py)


def rate(samples_per_s):
    """Samples/s as printed: whole numbers, with a decimal below 100 (a U-Net on a CPU)."""
    return f"{samples_per_s:.0f}" if samples_per_s >= 100 else f"{samples_per_s:.1f}"


def sync(device):
    """Wait for queued GPU work, so that the clock measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def last_batches(train_loader, steps, dataset):
    """The epoch's length in batches, and the sizes of its last `steps` batches (0: all of them).

    The recipe and the bound train on batches of these sizes: the recipe reaches them through
    skip_first_batches, its own mid-epoch resume path."""
    epoch_steps = len(train_loader)
    steps = steps or epoch_steps
    if steps > epoch_steps:
        raise SystemExit(f"error: --steps {steps} is more than one epoch ({epoch_steps} steps) of "
                         f"{dataset}")
    samples, batch_size = len(train_loader.dataset), train_loader.batch_size
    sizes = [batch_size] * epoch_steps
    sizes[-1] = samples - batch_size * (epoch_steps - 1)
    return epoch_steps, sizes[epoch_steps - steps:]


def bound_step(accelerator, model, optimizer, x, y):
    """The training step with nothing around it: the same model, loss, precision and optimizer."""
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def bound_rep(model, batches, train_step):
    """A repetition of the bound: train_step(x, y) on each of `batches`, already on the device."""
    def rep():
        model.train()
        for x, y in batches:
            train_step(x, y)
        return sum(len(y) for _, y in batches)

    return rep


def recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch):
    """A repetition of the recipe variant, run as main() runs an epoch: set_epoch (and the
    U-Net's augmentation epoch), then the last len(sizes) batches of the epoch, reached through
    skip_first_batches as a mid-epoch resume does, trained by train_epoch(loader).
    progress: the recipe's common.progress.Progress, which train_one_epoch updates."""
    def rep():
        loader.set_epoch(progress.epoch)  # a new order every epoch
        if hasattr(loader.dataset, "epoch"):
            loader.dataset.epoch = progress.epoch  # and new augmentations
        skip = epoch_steps - len(sizes)
        progress.batches_done = skip
        train = train_epoch(accelerator.skip_first_batches(loader, skip) if skip else loader)
        if progress.interrupted:  # Ctrl-C: train_one_epoch stopped (and checkpointed to scratch)
            raise KeyboardInterrupt
        progress.epoch += 1
        rep.peak_mb = train["peak_memory_mb"]
        return sum(sizes)

    return rep


def classic_rep(model, loader, steps, device, train_step):
    """A repetition of a tutorial loop: the first `steps` batches of `loader`, each sent to the
    device per batch as the tutorials do (images float32, targets int64), then train_step(x, y)."""
    def rep():
        model.train()
        samples = 0
        for i, (x, y) in enumerate(loader):
            if i == steps:
                break
            train_step(x.to(device, torch.float32), y.to(device, torch.long))
            samples += len(y)
        return samples

    return rep


# ---------------------------------------------------------------------------------------- MNIST


class ClassicMNIST(Dataset):
    """What torchvision.datasets.MNIST does per sample: uint8 array -> PIL image -> transform."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels  # uint8 [N, 28, 28], int64 [N]
        self.transform = transforms.Compose([transforms.ToTensor(),
                                             transforms.Normalize((0.1307,), (0.3081,))])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


def bench_mnist(args, accelerator):
    """Set up the MNIST variants. Returns (info, {variant: setup}), where setup() builds the
    variant and returns rep(): train one repetition and return the number of samples."""
    mnist = load_recipe("mnist")
    device = accelerator.device
    cfg = mnist.Config(dataset=args.dataset, output_dir=args.workdir, max_steps=0,
                       checkpoint_every_steps=0)
    cfg.validate()
    # The recipe's own data path, where main() puts it: on the GPU with data_on_device (default).
    train_loader, _ = mnist.make_loaders(cfg, device)
    train_set = train_loader.dataset
    images, labels = (t.cpu() for t in train_set.tensors)  # uint8 [N, 1, 28, 28], int64 [N]
    epoch_steps, sizes = last_batches(train_loader, args.steps, cfg.dataset)
    steps = len(sizes)

    def new_model():
        set_seed(cfg.seed)  # the same initial weights in every variant
        model = mnist.BasicNet()
        optimizer = torch.optim.Adadelta(model.parameters(), lr=cfg.lr)
        return model, optimizer

    def setup_recipe():
        model, optimizer = new_model()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg.gamma)
        model, optimizer, loader = accelerator.prepare(model, optimizer, train_loader)
        progress = Progress(accelerator, cfg, metric="accuracy")

        def train_epoch(epoch_loader):
            return mnist.train_one_epoch(model, epoch_loader, optimizer, scheduler, accelerator,
                                         cfg, progress, None)

        return recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch)

    def setup_bound():
        model, optimizer = new_model()
        model, optimizer = accelerator.prepare(model, optimizer)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
        batches, start = [], 0
        for n in sizes:
            idx = order[start:start + n]
            start += n
            batches.append((mnist.normalize(images[idx]).to(device), labels[idx].to(device)))
        return bound_rep(model, batches,
                         lambda x, y: bound_step(accelerator, model, optimizer, x, y))

    def setup_classic(workers):
        def setup():
            model, optimizer = new_model()
            model, optimizer = accelerator.prepare(model, optimizer)
            dataset = ClassicMNIST(images[:, 0].numpy(), labels.numpy())
            loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True,
                                num_workers=workers)

            return classic_rep(model, loader, steps, device,
                               lambda x, y: bound_step(accelerator, model, optimizer, x, y))

        return setup

    info = {
        "dataset": cfg.dataset,
        "train_samples": len(train_set),
        "batch_size": cfg.batch_size,
        "steps_per_rep": steps,
        "samples_per_rep": sum(sizes),
        "model": "BasicNet",
        "optimizer": f"Adadelta(lr={cfg.lr})",
        "recipe_loop": f"recipes/mnist.py make_loaders + train_one_epoch (num_workers "
                       f"{cfg.num_workers}, data_on_device {cfg.data_on_device})",
        "startup_cmd": [sys.executable, "recipes/mnist.py", "--dataset", cfg.dataset, "--smoke",
                        "--smoke_steps", "1"],
        "startup_marker": "mnist: ",  # main() prints this line after data, model and prepare()
        "what": {
            "recipe": "recipe's make_loaders + train_one_epoch",
            "bound": "normalised batches already on the device",
            "classic_w0": "PIL -> ToTensor -> Normalize, DataLoader num_workers 0",
            "classic_w1": "the same with num_workers 1",
        },
    }
    variants = {
        "recipe": setup_recipe,
        "bound": setup_bound,
        "classic_w0": setup_classic(0),
        "classic_w1": setup_classic(1),
    }
    return info, variants


# ----------------------------------------------------------------------------------------- U-Net


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
        return (torch.as_tensor(img.copy()).float().contiguous(),
                torch.as_tensor(mask.copy()).long().contiguous())


def bench_unet(args, accelerator):
    """Set up the U-Net variants, as bench_mnist does."""
    unet = load_recipe("unet")
    device = accelerator.device
    sizes = {k: getattr(args, k) for k in ("image_size", "batch_size")
             if getattr(args, k) is not None}
    cfg = unet.Config(dataset=args.dataset, output_dir=args.workdir, max_steps=0,
                      checkpoint_every_steps=0, **sizes)
    try:
        cfg.validate()
    except UserError as e:  # --image_size or --batch_size out of range: one line, as the recipe's
        raise SystemExit(f"error: {e}") from None
    set_deterministic(cfg.deterministic, benchmark=not cfg.bucket_by_size)  # as main() does
    cfg = dataclasses.replace(cfg, channels_last=str(device.type == "cuda").lower())  # main's auto
    if not (Path(cfg.dataset) / "imgs").is_dir():
        raise SystemExit(f"error: the U-Net bench needs a folder with imgs/ and masks/ (the "
                         f"classic loop opens the files), not {cfg.dataset}")
    # The recipe's own data path, as its main() builds it on one process.
    augment = functools.partial(unet.augment, cfg=cfg)
    data = load_data(cfg, accelerator, unet.input_channels, augment)
    cfg = dataclasses.replace(cfg, num_classes=data.num_classes, in_channels=data.in_channels)
    train_loader, values = data.train_loader, data.values
    train_source, _ = open_sources(cfg)  # the image and mask files, for the classic loop
    workers = worker_count(cfg.num_workers, 1)  # the recipe's when it does not cache
    train_set = train_loader.dataset
    epoch_steps, sizes = last_batches(train_loader, args.steps, cfg.dataset)
    steps = len(sizes)

    def new_model(cfg=cfg, tutorial=False):
        set_seed(cfg.seed)  # the same initial weights in every variant
        model = unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS})
        if cfg.channels_last == "true":
            model = model.to(memory_format=torch.channels_last)
        if tutorial:  # the recipe's AdamW settings, with the foreach kernels that milesial asks for
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                          weight_decay=cfg.weight_decay, foreach=True)
        else:
            optimizer = unet.make_optimizer(model, cfg.lr, cfg, accelerator)
        return model, optimizer

    def step(model, optimizer, x, y):
        """The recipe's training step with nothing around it: loss, backward, clipping, AdamW."""
        loss = unet.loss_per_image(model(x), y, cfg.num_classes).mean()
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
        # As main(): the cosine over all epochs' optimizer steps, stepped by train_one_epoch.
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * epoch_steps)
        progress = Progress(accelerator, cfg, metric="dice")

        def train_epoch(epoch_loader):
            return unet.train_one_epoch(model, epoch_loader, optimizer, scheduler, accelerator, cfg,
                                        progress, None, values)

        return recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch)

    def setup_bound():
        model, optimizer = new_model()
        model, optimizer = accelerator.prepare(model, optimizer)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
        batches, start = [], 0
        for n in sizes:  # the recipe's samples, flips included, as float images on the device
            pairs = [train_set[i] for i in order[start:start + n].tolist()]
            start += n
            x, y = (torch.stack(t) for t in zip(*pairs))
            batches.append((unet.prepare_input(x.to(device), cfg), y.to(device)))
        return bound_rep(model, batches, lambda x, y: step(model, optimizer, x, y))

    def setup_classic(workers):
        def setup():
            model, optimizer = new_model(tutorial=True)
            model, optimizer = accelerator.prepare(model, optimizer)
            dataset = ClassicSegmentation(train_source, values)
            # The tutorial pins memory; only a GPU has it (on a CPU, torch warns and ignores it).
            loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True,
                                num_workers=workers, pin_memory=device.type == "cuda")

            return classic_rep(model, loader, steps, device,
                               lambda x, y: step(model, optimizer, x, y))

        return setup

    x, y = train_set[0]  # a training sample as the model sees it: resized and cropped
    info = {
        "dataset": cfg.dataset,
        "train_samples": len(train_set),
        "batch_size": cfg.batch_size,
        "input_size": list(x.shape[1:]),
        "flops_per_sample": flops_per_sample(
            lambda: unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS}),
            x, y, lambda logits, y: unet.loss_per_image(logits, y, cfg.num_classes).mean()),
        "steps_per_rep": steps,
        "samples_per_rep": sum(sizes),
        "model": f"UNet(base_channels={cfg.base_channels})",
        "optimizer": f"AdamW(lr={cfg.lr}, weight_decay={cfg.weight_decay}), gradient norm clipped "
                     f"to {cfg.grad_clip}; recipe and bound: make_optimizer (fused kernels, except "
                     f"under fp16); classic: foreach kernels",
        "recipe_loop": f"recipes/unet_data.py load_data ({data.reading}) + recipes/unet.py "
                       f"train_one_epoch",
        "startup_cmd": [sys.executable, "recipes/unet.py", "--dataset", cfg.dataset, "--smoke",
                        "--smoke_steps", "1"],
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
        variants["recipe_cl"] = lambda: setup_recipe(dataclasses.replace(cfg, channels_last="true"))
    if "compile" in args.also:
        info["what"]["recipe_compile"] = ("the recipe, model compiled (torch.compile, inductor) "
                                          "after prepare()")
        variants["recipe_compile"] = lambda: setup_recipe(compile_model=True)
    return info, variants


# ------------------------------------------------------------------------- FLOPs and FLOP/s


def flops_per_sample(build_model, x, y, loss_fn):
    """FLOPs of training on one sample: forward and backward of the model and loss on a batch of
    two like (x, y), counted by torch.utils.flop_counter (matrix products and convolutions, the
    work that matters) on the meta device, where nothing is computed or stored."""
    with torch.device("meta"):
        model = build_model()
        x, y = torch.empty(2, *x.shape), torch.empty(2, *y.shape, dtype=y.dtype)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return counter.get_total_flops() // 2


def peak_dtype(accelerator):
    """The precision of the run's matrix products: fp32, or what mixed_precision asks for
    (the CPU runs fp16 configs in fp32, see common.runtime.describe)."""
    precision, device = accelerator.mixed_precision, accelerator.device
    if precision == "bf16" or (precision == "fp16" and device.type == "cuda"):
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.float32


def matmul_peak(device, dtype, seconds=1.0):
    """TFLOP/s of a large square matrix product in `dtype` on `device`: the peak that the run's
    precision reaches here (8192 x 8192 on a GPU, 1024 x 1024 on a CPU). In fp32 on a GPU the
    product may use TF32 when cuDNN's convolutions do (torch.backends.cudnn.allow_tf32, on by
    default), so that a model in fp32 is compared with the arithmetic it runs in."""
    n = 8192 if device.type == "cuda" else 1024
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty_like(a)
        for _ in range(3):
            torch.mm(a, b, out=out)
        products, start = 0, time.perf_counter()
        while True:
            sync(device)
            if time.perf_counter() - start >= seconds and products:
                break
            for _ in range(10):
                torch.mm(a, b, out=out)
            products += 10
        elapsed = time.perf_counter() - start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n**3 * products / elapsed / 1e12


def peak_name(device, dtype):
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda" and dtype == torch.float32 and torch.backends.cudnn.allow_tf32:
        name += " (TF32, as cuDNN convolutions)"
    return name


def flop_rates(results, flops, peaks):
    """Each variant's TFLOP/s (median and best samples/s x FLOPs per sample) and its fraction of
    the matrix-product peak, the higher of the two measured (before and after the rounds)."""
    peak = max(peaks)
    for res in results.values():
        res["tflops"] = round(res["median_samples_per_s"] * flops / 1e12, 4)
        res["tflops_best"] = round(res["best_samples_per_s"] * flops / 1e12, 4)
        res["fraction_of_peak"] = round(res["tflops"] / peak, 4)
        res["fraction_of_peak_best"] = round(res["tflops_best"] / peak, 4)
    return peak


def print_flop_rates(results, flops, peak, dtype_name):
    print(f"\n{flops / 1e9:.1f} GFLOP per sample (forward + backward); matrix-product peak "
          f"{peak:.3g} TFLOP/s in {dtype_name}")
    print(f"{'variant':<12} {'TFLOP/s':>9} {'best':>8} {'of peak':>8} {'best':>6}")
    for name, res in results.items():
        print(f"{name:<12} {res['tflops']:>9.3g} {res['tflops_best']:>8.3g} "
              f"{res['fraction_of_peak']:>8.1%} {res['fraction_of_peak_best']:>6.1%}")


def bench_loader(args, accelerator):
    """The U-Net's data path alone: one variant per --loader entry (recipe flags over the
    defaults), each rep() one epoch of the training loader, prepared as main() prepares it, with
    nothing done to the batches. rep.setup_s: seconds to build it (decoding, if it caches)."""
    unet = load_recipe("unet")
    variants = {}

    def setup(flags):
        cfg = parse_config(unet.Config, ["--dataset", args.dataset, "--output_dir", args.workdir,
                                         *shlex.split(flags)])
        start = time.perf_counter()
        augment = functools.partial(unet.augment, cfg=cfg)
        data = load_data(cfg, accelerator, unet.input_channels, augment)
        loader = accelerator.prepare(data.train_loader)
        epochs = itertools.count()

        def rep():
            epoch = next(epochs)
            loader.set_epoch(epoch)
            loader.dataset.epoch = epoch
            images = 0
            for _, y in loader:
                images += len(y)
            return images

        rep.setup_s = round(time.perf_counter() - start, 3)
        rep.data = str(data)
        return rep

    for flags in args.loader:
        variants[flags or "defaults"] = lambda flags=flags: setup(flags)
    return variants


def report_loader(args, accelerator):
    """Run bench_loader's variants in interleaved rounds; print a table, write the JSON."""
    variants = bench_loader(args, accelerator)
    device = accelerator.device
    print(f"unet loader: {args.dataset}, {args.warmup} warm-up + {args.reps} measured epochs each, "
          f"interleaved, {args.threads} threads, {device.type} ({device_name(device)})", flush=True)
    setups = {}

    def keep(name, setup):  # remember each variant's set-up time and data line
        def wrapped():
            rep = setup()
            setups[name] = {"setup_s": rep.setup_s, "data": rep.data}
            return rep
        return wrapped

    results = measure({name: keep(name, setup) for name, setup in variants.items()}, device,
                      args.warmup, args.reps)
    print(f"\n{'images/s median':>15} {'best':>8} {'set-up s':>9}  variant (recipe flags)")
    for name, res in results.items():
        res.update(setups[name])
        print(f"{rate(res['median_samples_per_s']):>15} {rate(res['best_samples_per_s']):>8} "
              f"{res['setup_s']:>9.2f}  {name}: {res['data']}")
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} after, on {os.cpu_count()} cores")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"recipe": "unet", "mode": "loader", "dataset": args.dataset,
                               "device": device.type, "device_name": device_name(device),
                               "threads": args.threads, "reps": args.reps, "variants": results},
                              indent=2) + "\n")
    print(f"wrote {out}")


# Each recipe's bench, and its defaults for what the command line leaves out. A U-Net step takes
# about 0.8 s on 2 CPU cores, so the U-Net measures 3 repetitions, not 7: 4 variants x (1 + 3)
# epochs of data/shapes (23 steps) take about 5 minutes there. Still whole epochs: a shorter
# repetition reaches its batches through skip_first_batches, whose new DataLoader starts new
# workers every repetition, and the first step after that fork takes about 2 s longer there
# (kernel time in the training process), a cost that training pays once, not every epoch.
RECIPES = {
    "mnist": (bench_mnist, {"dataset": "data/mnist_sample", "steps": 0, "reps": 7}),
    "unet": (bench_unet, {"dataset": "data/shapes", "steps": 0, "reps": 3}),
}


# ------------------------------------------------------------------ start-up, cold and warm cache

# What a timed start-up runs: the recipe's imports, a line that marks their end, then the recipe as
# `python recipes/NAME.py ARGS` runs. The imports include two that come later in the recipe:
# datasets (imported to load the data) and torch._dynamo, which torch imports when the first
# optimizer is made, in any script (1-4 s on 2 busy CPU cores).
STARTUP_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import datasets, torch._dynamo
from recipe_module import load_recipe
recipe = load_recipe({name!r})
print("bench: imports done", flush=True)
sys.argv = [recipe.__file__, *sys.argv[1:]]
recipe.run(recipe.main, recipe.Config)
"""
STARTUP_RUNS = {  # label: (what it is, more recipe arguments)
    "first": ("first run: datasets converts the files, the recipe decodes and caches", []),
    "second": ("second run: the decoded images read from the cache", []),
    "second_no_cache": ("second run with --cache_decoded false: decoded again",
                        ["--cache_decoded", "false"]),
}


def time_from_imports(name, args, env):
    """Run recipes/NAME.py ARGS once, as STARTUP_CHILD; return the seconds from launch to the end
    of its imports, and from there to its start-up line `NAME: ` (printed right before the first
    training step, after the data, the model and prepare())."""
    code = STARTUP_CHILD.format(tests=str(REPO / "tests"), name=name)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        for key, prefix in (("imports", "bench: imports done"), ("ready", f"{name}: ")):
            if key not in seen and line.startswith(prefix):
                seen[key] = time.perf_counter() - start
    if proc.wait() != 0 or len(seen) != 2:
        raise SystemExit(f"error: start-up run failed (exit {proc.returncode}): recipes/{name}.py "
                         f"{' '.join(map(str, args))}\n{''.join(lines)[-3000:]}")
    return {"launch_to_imports_done_s": round(seen["imports"], 3),
            "imports_done_to_first_step_s": round(seen["ready"] - seen["imports"], 3)}


def bench_startup_cache(args):
    """--startup_cache: start the recipe on args.dataset as in STARTUP_RUNS, one fresh process
    each, all on one datasets cache that starts empty (HF_DATASETS_CACHE in a temporary folder,
    removed after), and time each from the end of its imports to its first training step."""
    if args.recipe != "mnist":
        raise SystemExit("error: --startup_cache is for --recipe mnist, the recipe with "
                         "cache_decoded")
    folder = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    print(f"{args.recipe} start-up on {args.dataset}, {os.cpu_count()} cores, from the end of the "
          f"imports to the first training step (3 launches; load average "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    runs = {}
    try:
        for label, (what, more) in STARTUP_RUNS.items():
            recipe_args = ["--dataset", args.dataset, "--smoke", "--smoke_steps", 1,
                           "--output_dir", folder / label, *more]
            cache = {"HF_DATASETS_CACHE": str(folder / "cache")}
            runs[label] = {"what": what, **time_from_imports(args.recipe, recipe_args, cache)}
            print(f"  {runs[label]['imports_done_to_first_step_s']:6.2f} s  {what} (imports "
                  f"{runs[label]['launch_to_imports_done_s']:.2f} s before)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"recipe": args.recipe, "dataset": args.dataset, "torch": torch.__version__,
              "cpu_cores": os.cpu_count(), "load_average_1min_after": round(os.getloadavg()[0], 2),
              "runs": runs}
    out = Path(args.json or f"runs/bench/{args.recipe}-startup.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------- driver


def measure(variants, device, warmup, reps):
    """Set up and warm up each variant in turn, then run them round-robin, each round starting
    one variant later (so that none always follows the same one: the classic loop's worker
    exiting, say). Returns per-variant lists of samples/s and the peak memory read after the
    variant's warm-up."""
    runs, results = {}, {}
    for name, setup in variants.items():
        reset_peak(device)
        rep = setup()
        for _ in range(warmup):
            rep()
        sync(device)
        runs[name] = rep
        results[name] = {"samples_per_s": [], "seconds": [], "samples": [],
                         "peak_memory_mb": getattr(rep, "peak_mb", None) or peak_memory_mb(device)}
    names = list(runs)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rep = runs[name]
            sync(device)
            start = time.perf_counter()
            samples = rep()
            sync(device)
            seconds = time.perf_counter() - start
            res = results[name]
            res["samples"].append(samples)
            res["seconds"].append(round(seconds, 4))
            # 2 decimals: a U-Net on a CPU does ~10/s.
            res["samples_per_s"].append(round(samples / seconds, 2))
        print(f"  round {r + 1}/{reps}: " + ", ".join(f"{n} {rate(res['samples_per_s'][-1])}"
                                                    for n, res in results.items()), flush=True)
    for res in results.values():
        res["median_samples_per_s"] = statistics.median(res["samples_per_s"])
        res["best_samples_per_s"] = max(res["samples_per_s"])
    return results


def paired(results, a, b):
    """The median over rounds of a's samples/s over b's in the same round."""
    pairs = zip(results[a]["samples_per_s"], results[b]["samples_per_s"])
    return round(statistics.median(x / y for x, y in pairs), 3)


def time_startup(cmd, marker, runs, workdir):
    """Launch the recipe `runs` times; return the seconds from launch to the first stdout line that
    starts with `marker`, and to the process's exit."""
    out = []
    for i in range(runs):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full = cmd + ["--output_dir", str(Path(workdir) / f"startup-{i}")]
        start = time.perf_counter()
        proc = subprocess.Popen(full, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        stderr = []
        drain = threading.Thread(target=lambda: stderr.append(proc.stderr.read()))  # no deadlock
        drain.start()
        ready, lines, last = None, [], 0.0
        for line in proc.stdout:
            lines.append(line)
            last = time.perf_counter() - start
            if ready is None and line.startswith(marker):
                ready = last
        proc.wait()
        total = time.perf_counter() - start
        drain.join()
        if proc.returncode != 0 or ready is None:
            raise SystemExit(f"error: start-up run failed (exit {proc.returncode}, start-up line "
                             f"{marker!r} {'seen' if ready else 'not seen'}): {' '.join(full)}\n"
                             f"{''.join(lines)[-2000:]}{stderr[0][-2000:]}")
        out.append({"to_first_step_s": round(ready, 3), "to_exit_s": round(total, 3),
                    "exit_s": round(total - last, 3)})
    return out


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def main():
    per_recipe = "; ".join(f"{name}: " + ", ".join(f"--{k} {v}" for k, v in defaults.items())
                           for name, (_, defaults) in RECIPES.items())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=f"Defaults per recipe: {per_recipe}.")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="mnist")
    p.add_argument("--dataset", help="what the recipe's --dataset takes (default: per recipe)")
    p.add_argument("--steps", type=int, help="optimizer steps per repetition, the last of an epoch "
                                             "(0: one epoch; default: per recipe)")
    p.add_argument("--reps", type=int,
                   help="measured repetitions of each variant (default: per recipe)")
    p.add_argument("--warmup", type=int, default=1,
                   help="repetitions of each variant before measuring")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads, all variants")
    p.add_argument("--startup_runs", type=int, default=3, help="recipe launches to time (0: skip)")
    p.add_argument("--json", help="where to write the results (default runs/bench/<recipe>.json)")
    p.add_argument("--loader", nargs="*", metavar="FLAGS",
                   help='U-Net: measure the training loader alone, once per FLAGS (recipe '
                        'settings, "" for the defaults), with no model (see above)')
    p.add_argument("--also", nargs="+", default=[], choices=["channels_last", "compile"],
                   help="U-Net: also measure the recipe with channels_last, or compiled (see "
                        "above)")
    p.add_argument("--image_size", type=int,
                   help="U-Net: the recipe's image_size (default: the recipe's)")
    p.add_argument("--batch_size", type=int,
                   help="U-Net: the recipe's batch_size (default: the recipe's)")
    p.add_argument("--startup_cache", action="store_true",
                   help="only time start-up: a first and a second launch on an empty datasets "
                        "cache (see above)")
    args = p.parse_args()
    bench, defaults = RECIPES[args.recipe]
    for key, value in defaults.items():  # what the command line left out
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.startup_cache:
        return bench_startup_cache(args)
    loader = "_loader" if args.loader is not None else ""
    args.json = args.json or f"runs/bench/{args.recipe}{loader}.json"
    if min(args.steps, args.warmup, args.startup_runs) < 0 or min(args.reps, args.threads) < 1:
        p.error("--steps, --warmup and --startup_runs cannot be negative; --reps and --threads "
                "must be at least 1")
    sized = args.image_size is not None or args.batch_size is not None
    if (args.also or sized) and args.recipe != "unet":
        p.error("--also, --image_size and --batch_size are for --recipe unet")
    if args.loader is not None and args.recipe != "unet":
        p.error("--loader is for --recipe unet")
    args.loader = [""] if args.loader == [] else args.loader

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    accelerator = build_accelerator()
    if accelerator.num_processes != 1:
        raise SystemExit("error: the bench measures one process: launch it with --num_processes 1")
    device = accelerator.device
    workdir = tempfile.mkdtemp(prefix="bench-")
    args.workdir = str(Path(workdir) / "recipe")
    if args.loader:
        try:
            report_loader(args, accelerator)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        close(accelerator)
        return
    try:
        info, variants = bench(args, accelerator)
        print(f"{args.recipe}: {info['steps_per_rep']} steps = {info['samples_per_rep']} samples "
              f"per repetition, {args.warmup} warm-up + {args.reps} measured each, interleaved, "
              f"{args.threads} threads, {device.type} ({device_name(device)}), precision "
              f"{accelerator.mixed_precision}", flush=True)
        dynamo = accelerator.state.dynamo_plugin  # the accelerate config's dynamo_config
        if dynamo.backend.value != "NO":
            print(f"  prepare() compiles every model: backend {dynamo.backend.value.lower()}, "
                  f"mode {dynamo.mode}", flush=True)
        flops, dtype = info.get("flops_per_sample"), peak_dtype(accelerator)
        if flops:
            print(f"  {flops / 1e9:.1f} GFLOP per sample; timing a matrix product in "
                  f"{peak_name(device, dtype)}", flush=True)
            peaks = [matmul_peak(device, dtype)]
        results = measure(variants, device, args.warmup, args.reps)
        if flops:
            peaks.append(matmul_peak(device, dtype))  # again: the less disturbed of the two counts
        startup = []
        if args.startup_runs:
            print(f"  launching the recipe {args.startup_runs} time(s) to time start-up",
                  flush=True)
            startup = time_startup(info["startup_cmd"], info["startup_marker"], args.startup_runs,
                                   workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {name: res["median_samples_per_s"] for name, res in results.items()}
    best = {name: res["best_samples_per_s"] for name, res in results.items()}
    classic = max((n for n in med if n.startswith("classic")), key=med.get)
    report = {
        "recipe": args.recipe,
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "threads": args.threads,
        "precision": accelerator.mixed_precision,
        "torch_compile": dynamo.to_dict() if dynamo.backend.value != "NO" else None,
        **{k: v for k, v in info.items() if k != "startup_marker"},
        "warmup_reps": args.warmup,
        "reps": args.reps,
        "peak_memory_note": ("max CUDA memory allocated, from the variant's set-up through its "
                             "warm-up" if device.type == "cuda" else
                             "process RSS high-water mark after the variant's warm-up; variants "
                             "run in one process in this order, so only the first (recipe) is its "
                             "own"),
        "variants": results,
        "classic_compared": classic,
        "recipe_over_bound": round(med["recipe"] / med["bound"], 3),
        "recipe_over_classic": round(med["recipe"] / med[classic], 3),
        # Per round: the variants of one round ran back to back, so they saw much the same load.
        "recipe_over_bound_paired": paired(results, "recipe", "bound"),
        "recipe_over_classic_paired": paired(results, "recipe", classic),
        # Other work on the machine only ever slows a repetition down, so the best repetition is
        # the least disturbed one.
        "recipe_over_bound_best": round(best["recipe"] / best["bound"], 3),
        "recipe_over_classic_best": round(best["recipe"] / max(v for n, v in best.items()
                                                               if n.startswith("classic")), 3),
        # --also: each variant's speed over the plain recipe's.
        "also_over_recipe": {name: {"ratio_of_medians": round(med[name] / med["recipe"], 3),
                                    "paired": paired(results, name, "recipe")}
                             for name in results if name.startswith("recipe_")},
        "load_average_1min": {"before": round(load_before[0], 2),
                              "after": round(os.getloadavg()[0], 2), "cpu_cores": os.cpu_count()},
        "startup_definition": ("seconds from launching `startup_cmd` to its start-up line "
                               "(printed after the data is loaded and decoded, the model built and "
                               "prepare() done: right before the first training step); to_exit_s: "
                               "the whole 1-step smoke run, eval and writes included; exit_s: from "
                               "its last output line to the process's exit"),
        "startup": startup,
    }
    if startup:
        report["startup_median_s"] = statistics.median(s["to_first_step_s"] for s in startup)

    print(f"\n{'variant':<12} {'median/s':>9} {'best/s':>8} {'worst/s':>8} {'peak MB':>8}  what")
    for name, res in results.items():
        print(f"{name:<12} {rate(res['median_samples_per_s']):>9} "
              f"{rate(res['best_samples_per_s']):>8} {rate(min(res['samples_per_s'])):>8} "
              f"{res['peak_memory_mb']:>8.0f}  {info['what'][name]}")
    for other, key in (("bound", "bound"), (f"classic ({classic}, the faster median)", "classic")):
        print(f"recipe/{other}: {report[f'recipe_over_{key}']:.3f} ratio of medians, "
              f"{report[f'recipe_over_{key}_paired']:.3f} median of per-round ratios, "
              f"{report[f'recipe_over_{key}_best']:.3f} ratio of best repetitions")
    for name, ratio in report["also_over_recipe"].items():
        print(f"{name}/recipe: {ratio['ratio_of_medians']:.3f} ratio of medians, "
              f"{ratio['paired']:.3f} median of per-round ratios")
    load = report["load_average_1min"]
    print(f"load average {load['before']} before, {load['after']} after, on {load['cpu_cores']} "
          f"cores")
    if startup:
        print(f"start-up to first step {report['startup_median_s']:.2f} s (median of "
              f"{', '.join(str(s['to_first_step_s']) for s in startup)}); whole 1-step smoke run "
              f"{statistics.median(s['to_exit_s'] for s in startup):.2f} s, of which exit after "
              f"the last line {statistics.median(s['exit_s'] for s in startup):.2f} s")
    if flops:
        report["matmul_peak_tflops"] = {"precision": peak_name(device, dtype),
                                        "measured": [round(p, 4) for p in peaks],
                                        "used": round(flop_rates(results, flops, peaks), 4)}
        print_flop_rates(results, flops, report["matmul_peak_tflops"]["used"],
                         peak_name(device, dtype))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    close(accelerator)


if __name__ == "__main__":
    main()
