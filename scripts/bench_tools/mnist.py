"""The MNIST variants, each built from recipes/mnist.py: its Config (and --config preset), model,
optimizer (make_optimizer), schedule (make_scheduler), loaders and train_one_epoch."""

import dataclasses
import sys

import torch
import torch.nn as nn
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from bench_tools import load_recipe, recipe_config
from bench_tools.loops import bound_rep, bound_step, classic_rep, last_batches, recipe_rep
from common.progress import Progress


class ClassicMNIST(Dataset):
    """What torchvision.datasets.MNIST does per sample: uint8 array -> PIL image -> transform."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels  # uint8 [N, 28, 28], int64 [N]
        self.transform = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
        )

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(Image.fromarray(self.images[i])), int(self.labels[i])


class TinyNet(nn.Module):
    """One Linear layer on the flattened digit (--tiny_model): its step is nearly all host work."""

    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(28 * 28, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))


def bench_mnist(args, accelerator):
    """Set up the MNIST variants. Returns (info, {variant: setup}), where setup() builds the
    variant and returns rep(): train one repetition and return the number of samples."""
    mnist = load_recipe("mnist")
    device = accelerator.device
    cfg = recipe_config(mnist, args)
    # The recipe's own data path, where main() puts it: on the GPU with data_on_device (default).
    train_loader, _ = mnist.make_loaders(cfg, device)
    train_set = train_loader.dataset
    images, labels = (t.cpu() for t in train_set.tensors)  # uint8 [N, 1, 28, 28], int64 [N]
    epoch_steps, sizes = last_batches(train_loader, args.steps, cfg.dataset, at_most=args.quick)
    steps = len(sizes)
    lr = cfg.scaled_lr(accelerator.num_processes)

    def new_model():
        set_seed(cfg.seed)  # the same initial weights in every variant
        classes = len(train_set.classes)
        model = TinyNet(classes) if args.tiny_model else mnist.BasicNet(num_classes=classes)
        return model, mnist.make_optimizer(model, cfg, lr=lr, accelerator=accelerator)

    def setup_recipe():
        model, optimizer = new_model()
        model, optimizer, loader = accelerator.prepare(model, optimizer, train_loader)
        scheduler = mnist.make_scheduler(optimizer, cfg, len(loader))  # as main(): unprepared
        progress = Progress(accelerator, cfg, metric="accuracy")

        def train_epoch(epoch_loader):
            return mnist.train_one_epoch(
                model, epoch_loader, optimizer, scheduler, accelerator, cfg, progress, None
            )

        return recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch)

    def setup_bound():
        model, optimizer = new_model()
        model, optimizer = accelerator.prepare(model, optimizer)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
        batches, start = [], 0
        for n in sizes:
            idx = order[start : start + n]
            start += n
            batches.append((mnist.normalize(images[idx]).to(device), labels[idx].to(device)))
        return bound_rep(
            model, batches, lambda x, y: bound_step(accelerator, model, optimizer, x, y)
        )

    def setup_classic(workers):
        def setup():
            model, optimizer = new_model()
            model, optimizer = accelerator.prepare(model, optimizer)
            dataset = ClassicMNIST(images[:, 0].numpy(), labels.numpy())
            loader = DataLoader(
                dataset, batch_size=cfg.batch_size, shuffle=True, num_workers=workers
            )

            return classic_rep(
                model,
                loader,
                steps,
                device,
                lambda x, y: bound_step(accelerator, model, optimizer, x, y),
            )

        return setup

    preset = ["--config", args.config] if args.config else []
    shift = f", each image shifted by up to {cfg.shift} px" if cfg.shift else ""
    info = {
        "dataset": cfg.dataset,
        "config": args.config,
        "settings": dataclasses.asdict(cfg),
        "train_samples": len(train_set),
        "batch_size": cfg.batch_size,
        "steps_per_rep": steps,
        "samples_per_rep": sum(sizes),
        "steps_per_epoch": epoch_steps,
        "model": "TinyNet (one Linear layer)" if args.tiny_model else "BasicNet",
        "optimizer": f"{cfg.optimizer}(lr={lr:g}, weight_decay={cfg.weight_decay:g}), scheduler "
        f"{cfg.scheduler}; recipes/mnist.py make_optimizer and make_scheduler",
        "recipe_loop": f"recipes/mnist.py make_loaders + train_one_epoch (num_workers "
        f"{cfg.num_workers}, data_on_device {cfg.data_on_device}{shift})",
        "startup_cmd": [
            sys.executable,
            "recipes/mnist.py",
            "--dataset",
            cfg.dataset,
            *preset,
            "--smoke",
            "--smoke_steps",
            "1",
        ],
        "startup_marker": "mnist: ",  # main() prints this line after data, model and prepare()
        "what": {
            "recipe": "recipe's make_loaders + train_one_epoch",
            "bound": "normalised batches already on the device"
            + (", no shift" if cfg.shift else ""),
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
