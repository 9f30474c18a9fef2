"""How well can the U-Net's encoder name the digits of a shape-coded set when it is told where
each one is? A classifier on crops, held against the U-Net's own naming (docs/learning.md).

    python scripts/studies/name_digits.py --dataset data/digits_shape
    python scripts/studies/name_digits.py --dataset data/digits_shape2 --base_channels 32 \
        --epochs 60

The encoder is recipes/unet.py's own (unet_model.py's build_unet: its first level and the 4 levels
down, at --base_channels), then an average over the positions and a linear layer to the 10 digits.
The data is the recipe's split of --dataset (common/segmentation/pairs.py), each image resized to
--size as the recipe's --image_size does (the image bilinear, the mask by nearest neighbour); each
digit class in a mask is one digit, cropped as a square 1.2 times its pixels' bounding box and
resized to 32x32 (past the image's edges: black). Training: AdamW at --lr with the recipe's weight
decay, a cosine over the run, batches of --batch_size digits, --epochs passes; each crop is resized
by 0.8 to 1.25 times and moved by up to a tenth of its side, as the recipe's zoom moves a digit.
After each epoch it prints the share of the held-out digits named right.
"""

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes"), str(REPO)]

from common.segmentation.pairs import folder_splits  # noqa: E402
from unet_model import build_unet  # noqa: E402

CROP = 32  # the classifier's input side
MARGIN = 1.2  # a crop's side, in bounding boxes


def digits(pairs, size, ignored):
    """[(image float [3, size, size] in 0..1, (top, bottom, left, right), digit)] for each class
    but the background (mask value 0) and the `ignored` values in each mask; digit: value - 1."""
    found = []
    for image, mask, _ in pairs:
        image = Image.open(image).convert("RGB").resize((size, size), Image.BILINEAR)
        mask = np.array(Image.open(mask).resize((size, size), Image.NEAREST))
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
        for value in np.unique(mask):
            if value == 0 or value in ignored:
                continue
            ys, xs = np.nonzero(mask == value)
            box = (ys.min(), ys.max() + 1, xs.min(), xs.max() + 1)
            found.append((x, box, int(value) - 1))
    return found


def crop(image, box, rng=None):
    """The digit in `box` as [3, CROP, CROP]; with rng, resized and moved at random."""
    top, bottom, left, right = box
    cy, cx, side = (top + bottom) / 2, (left + right) / 2, MARGIN * max(bottom - top, right - left)
    if rng is not None:
        side *= rng.uniform(0.8, 1.25)
        cy, cx = cy + rng.uniform(-0.1, 0.1) * side, cx + rng.uniform(-0.1, 0.1) * side
    s = max(round(side), 4)
    return TF.resized_crop(
        image, round(cy - side / 2), round(cx - side / 2), s, s, [CROP, CROP], antialias=True
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="data/digits_shape", help="a folder with imgs/, masks/")
    p.add_argument("--ignore_index", default="255", help="mask values that are no digit")
    p.add_argument("--size", type=int, default=64, help="the recipe's --image_size")
    p.add_argument("--base_channels", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    root = Path(args.dataset)
    ignored = [int(v) for v in args.ignore_index.split(",") if v]
    train_pairs, val_pairs = folder_splits(root / "imgs", root / "masks")
    train, val = digits(train_pairs, args.size, ignored), digits(val_pairs, args.size, ignored)
    unet = build_unet(
        num_classes=10, in_channels=3, encoder="", base_channels=args.base_channels, bilinear=False
    )
    width = args.base_channels * 2**4  # the deepest level's channels
    model = nn.Sequential(
        unet.inc, *unet.downs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * -(-len(train) // args.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    held_x = torch.stack([crop(x, box) for x, box, _ in val])
    held_y = torch.tensor([digit for *_, digit in val])
    print(
        f"name digits: {len(train)} training and {len(val)} held-out digits of {args.dataset} "
        f"at {args.size}x{args.size}, the U-Net's encoder at base {args.base_channels}, AdamW lr "
        f"{args.lr:g}, {args.epochs} epochs of batches of {args.batch_size}",
        flush=True,
    )
    for epoch in range(1, args.epochs + 1):
        model.train()
        rng.shuffle(train)
        for i in range(0, len(train), args.batch_size):
            batch = train[i : i + args.batch_size]
            x = torch.stack([crop(image, box, rng) for image, box, _ in batch])
            loss = F.cross_entropy(model(x), torch.tensor([digit for *_, digit in batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        model.eval()
        with torch.no_grad():
            right = (model(held_x).argmax(1) == held_y).float().mean().item()
        print(f"epoch {epoch}: held-out digits named right {right:.3f}", flush=True)


if __name__ == "__main__":
    main()
