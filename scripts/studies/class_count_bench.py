"""What the number of classes costs the U-Net: a training step and an evaluation batch.

    python scripts/studies/class_count_bench.py             # 117 and 2 classes, batch 4 of 192x224
    python scripts/studies/class_count_bench.py --classes 150,21,2 --reps 3

For each class count, recipes/unet.py's U-Net at base_channels 16, on random images and labels
(a band of ignored pixels on the left): one training step (forward, loss_per_image, backward,
fused AdamW) and one evaluation batch (forward, loss_per_image, confusion_counts, dice_counts),
each timed with the recipe's loss and metric, and with the dense one-hot ones the recipe had
before (an [N, C, H, W] one-hot for the soft Dice, and one boolean [N, C - 1, H, W] map per
class for the hard Dice counts), which give the same sums (tests/test_unet_metrics.py). The
variants alternate, and each time is the median of --reps after a warm-up. Prints a markdown
table: images per second, and how much slower each is than with the fewest classes.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "recipes"), str(REPO / "tests")]

import torch
import torch.nn.functional as F
from recipe_module import load_recipe

from common.segmentation.data import IGNORE
from common.segmentation.inference import predicted_classes
from common.segmentation.metrics import confusion_counts

unet = load_recipe("unet")


def dense_loss(logits, target, *, num_classes):
    """The recipe's loss as it was: the soft Dice of every class, from a dense one-hot."""
    logits, valid = logits.float(), (target != IGNORE).float()
    pixels, target = valid.sum((1, 2)).clamp(min=1), target.clamp(min=0)
    ce = F.cross_entropy(logits, target, reduction="none")
    probs, onehot = logits.softmax(1), F.one_hot(target, num_classes).permute(0, 3, 1, 2)
    probs, onehot = probs * valid[:, None], onehot * valid[:, None]
    inter, total = (probs * onehot).sum((2, 3)), (probs + onehot).sum((2, 3))
    return (ce * valid).sum((1, 2)) / pixels + 1 - ((2 * inter + 1) / (total + 1)).mean(1)


def dense_dice_counts(logits, target, num_classes):
    """The recipe's hard Dice counts as they were: a boolean map per foreground class."""
    pred = torch.where(target == IGNORE, 0, predicted_classes(logits, num_classes))
    classes = torch.arange(1, num_classes)[:, None, None]
    pred, true = pred[:, None] == classes, target[:, None] == classes
    return (pred & true).sum((2, 3)), pred.sum((2, 3)) + true.sum((2, 3))


def time_variants(x, classes, reps):
    """{(what, variant): [seconds, ...]} of --reps alternating runs, after a warm-up."""
    batch, _, height, width = x.shape
    y = torch.randint(0, classes, (batch, height, width))
    y[:, :, :8] = IGNORE
    settings = dict(in_channels=3, num_classes=classes, encoder="", bilinear=False)
    model = unet.build_model({**settings, "base_channels": 16})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def train(loss_fn):
        loss_fn(model(x), y, num_classes=classes).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    @torch.inference_mode()
    def evaluate(recipe):
        logits = model(x)
        if recipe:
            unet.loss_per_image(logits, y, num_classes=classes)
            unet.dice_counts(confusion_counts(logits, y, classes), classes)
        else:
            dense_loss(logits, y, num_classes=classes)
            confusion_counts(logits, y, classes)
            dense_dice_counts(logits, y, classes)

    variants = {
        ("training step", "recipe"): lambda: train(unet.loss_per_image),
        ("training step", "dense one-hot"): lambda: train(dense_loss),
        ("evaluation batch", "recipe"): lambda: evaluate(True),
        ("evaluation batch", "dense one-hot"): lambda: evaluate(False),
    }
    for run in variants.values():  # warm-up
        run()
    seconds = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", default="117,2", help="class counts, comma-separated")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", default="192x224", help="HxW, multiples of 16")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    height, width = (int(v) for v in args.size.split("x"))
    counts = [int(c) for c in args.classes.split(",")]
    torch.manual_seed(0)
    x = torch.rand(args.batch, 3, height, width)
    median = {}
    for classes in counts:
        for (what, variant), times in time_variants(x, classes, args.reps).items():
            median[what, variant, classes] = statistics.median(times)
    fewest, threads = min(counts), torch.get_num_threads()
    print(f"batch {args.batch} of 3x{height}x{width}, base_channels 16, {threads} thread(s)\n")
    print(f"| what | loss and Dice | classes | images/s | x the time with {fewest} |")
    print("|---|---|---|---|---|")
    for (what, variant, classes), s in median.items():
        ratio = s / median[what, variant, fewest]
        print(f"| {what} | {variant} | {classes} | {args.batch / s:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
