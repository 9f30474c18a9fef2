"""The plain PyTorch loop that `--overfit_batches` is held against: can the U-Net memorise a few
images at all, with nothing of the recipe around it?

    python scripts/studies/overfit_plain.py --dataset data/digits_shape --ignore_index 255
    python scripts/studies/overfit_plain.py --dataset data/digits_shape --ignore_index 255 --lr 1e-3

The same U-Net as recipes/unet.py (recipes/unet_model.py, --base_channels), on the first --images
training images of the recipe's split (common/segmentation/pairs.py: the images --overfit_batches
takes on one process), read with PIL and resized to --size (the image bilinear, the mask by nearest
neighbour), in batches of --batch_size in a fixed order. Cross-entropy alone, AdamW at a constant
--lr, no clipping, no schedule, no augmentation. Every --every steps it evaluates the same images in
eval mode and prints the mean IoU and each class's IoU, from one confusion matrix over all pixels,
as the recipe's miou is.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes"), str(REPO)]

from common.segmentation.pairs import folder_splits  # noqa: E402
from unet_model import build_unet  # noqa: E402

IGNORE = -1


def load(pairs, size, ignored):
    """(images float [N, 3, size, size] in 0..1, class indices [N, size, size], the values):
    class i is the i-th smallest mask value found, `ignored` values are IGNORE."""
    images, masks = [], []
    for image, mask, _ in pairs:
        image = Image.open(image).convert("RGB").resize((size, size), Image.BILINEAR)
        mask = Image.open(mask).resize((size, size), Image.NEAREST)
        images.append(torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255)
        masks.append(torch.from_numpy(np.array(mask, dtype=np.int64)))
    masks = torch.stack(masks)
    values = sorted(set(masks.unique().tolist()) - set(ignored))
    target = torch.full_like(masks, IGNORE)
    for i, v in enumerate(values):
        target[masks == v] = i
    return torch.stack(images), target, values


@torch.no_grad()
def iou_per_class(model, images, target, classes):
    model.eval()
    predicted = model(images).argmax(1)
    model.train()
    valid = target != IGNORE
    matrix = torch.bincount(
        target[valid] * classes + predicted[valid], minlength=classes * classes
    ).view(classes, classes)
    hits = matrix.diagonal().double()
    union = matrix.sum(0) + matrix.sum(1) - matrix.diagonal()
    return [(h / u).item() if u else None for h, u in zip(hits, union)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="data/digits_shape", help="a folder with imgs/, masks/")
    p.add_argument("--ignore_index", default="", help="mask values that count for nothing: 255")
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--base_channels", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    root = Path(args.dataset)
    train, _ = folder_splits(root / "imgs", root / "masks")
    ignored = [int(v) for v in args.ignore_index.split(",") if v]
    images, target, values = load(train[: args.images], args.size, ignored)
    classes = len(values)
    model = build_unet(
        num_classes=classes,
        in_channels=3,
        encoder="",
        base_channels=args.base_channels,
        bilinear=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = list(zip(images.split(args.batch_size), target.split(args.batch_size)))
    print(
        f"plain loop: {len(images)} images of {args.size}x{args.size}, {classes} classes "
        f"(values {values}), {len(batches)} batches of {args.batch_size}, AdamW lr {args.lr:g}, "
        f"cross-entropy, {args.steps} steps",
        flush=True,
    )
    for step in range(1, args.steps + 1):
        x, y = batches[(step - 1) % len(batches)]
        loss = F.cross_entropy(model(x), y, ignore_index=IGNORE)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0 or step == args.steps:
            iou = iou_per_class(model, images, target, classes)
            present = [v for v in iou if v is not None]
            print(
                f"step {step}: loss {loss.item():.4f}, miou {sum(present) / len(present):.4f}, "
                f"lowest class IoU {min(present):.3f}, per class "
                f"{' '.join('-' if v is None else f'{v:.2f}' for v in iou)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
