"""What grad_checkpointing saves and costs: activation memory and step time of the U-Nets; and
what evaluation takes against a training step.

    python scripts/studies/activation_memory.py                   # batch 8 of 3x256x256, fp32, CPU
    python scripts/studies/activation_memory.py --size 128 --batch 4 --reps 5
    python scripts/studies/activation_memory.py --evaluation 4,8,16 --batch 4 --size 640 --width 960

For each model (recipes/unet_model.py: the classic UNet at base_channels 64 and 16, ResNetUNet
with resnet34 at 16), without and with grad_checkpointing, one training forward pass is
measured: the bytes of the tensors that autograd keeps for backward, seen by
torch.autograd.graph.saved_tensors_hooks, each storage counted once (in-place ReLUs and views
share one) and the model's own parameters and buffers not counted (they are in memory anyway).
That is the activation memory held from the forward to the backward; with checkpointing, the
backward adds one level's activations at a time while it recomputes that level.
Then the seconds of one training step (forward, cross-entropy, backward), the median of --reps
after one warm-up step, so the cost of the recompute shows. Prints a markdown table.

--evaluation N,...: instead, the peak memory of the default U-Net (base 64, 2 classes) in a
training step of --batch images (the forward in bf16 autocast, the recipe's loss, backward,
AdamW), with and without grad_checkpointing, and of evaluating N images (the model, the loss and
the Dice counts, under inference_mode), counted by torch's MemTracker on fake tensors: nothing
is allocated or computed, so a CPU counts a GPU-sized run in seconds. cuDNN's workspaces and the
confusion matrix's indices are not counted.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "recipes")]  # common/ and the recipes' unet_model

import torch
import torch.nn.functional as F

from unet_model import ResNetUNet, UNet, build_unet

NUM_CLASSES = 2
MODELS = {  # name in the table -> a builder taking grad_checkpointing
    "UNet, base 64": lambda gc: UNet(NUM_CLASSES, base_channels=64, grad_checkpointing=gc),
    "UNet, base 16": lambda gc: UNet(NUM_CLASSES, base_channels=16, grad_checkpointing=gc),
    "ResNetUNet resnet34, base 16": lambda gc: ResNetUNet(
        NUM_CLASSES, base_channels=16, encoder="resnet34", grad_checkpointing=gc
    ),
}


def saved_activation_bytes(model, x):
    """Bytes of the tensors that one forward of model (as it is: train() for a training pass)
    on x keeps for backward, each storage once, the model's parameters and buffers left out."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return sum(saved.values())


def step_seconds(model, x, target, reps):
    """The median seconds of one forward and backward, after one warm-up step."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        F.cross_entropy(model(x), target).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def peak_bytes(work, *args, tracked):
    """The peak bytes of work(*args), counted by torch's MemTracker (fake tensors count too)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        work(*args)
    return sum(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values())


def training_and_evaluation_peaks(*, batch, eval_images, height, width, grad_checkpointing):
    """(peak bytes of a training step of `batch` images, [peak bytes of evaluating n images for
    n in eval_images]) for the default U-Net of recipes/unet.py, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import unet  # recipes/unet.py: its model, loss and Dice counts

    classes = NUM_CLASSES

    def batch_of(n):
        x = torch.randint(0, 256, (n, 3, height, width), dtype=torch.uint8)
        return x.float() / 255, torch.randint(0, classes, (n, height, width))

    def train_step(model, optimizer, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        unet.loss_per_image(logits, y, num_classes=classes).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def evaluation(model, x, y):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).float()
            unet.loss_per_image(logits, y, num_classes=classes)
            # confusion_counts' selection of the counted pixels has no shape on fake tensors:
            # its index of (true, predicted) pairs, [N, H, W], stands in for it.
            index = y * classes + logits.argmax(1)
            unet.dice_counts(index.new_zeros(len(y), classes * classes), classes)

    with FakeTensorMode():
        settings = dict(in_channels=3, num_classes=classes, encoder="", base_channels=64)
        model = build_unet(**settings, bilinear=False, grad_checkpointing=grad_checkpointing)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, optimizer, *batch_of(batch))  # the optimizer's state exists from here
        training = peak_bytes(
            train_step, model, optimizer, *batch_of(batch), tracked=(model, optimizer)
        )
        model.eval()
        evaluating = [
            peak_bytes(evaluation, model, *batch_of(n), tracked=(model,)) for n in eval_images
        ]
    return training, evaluating


def print_peaks(args):
    """The --evaluation table."""
    counts = [int(n) for n in args.evaluation.split(",")]
    size = dict(height=args.size, width=args.width or args.size)
    print(
        f"the default U-Net at {size['height']}x{size['width']}, bf16 autocast, fake tensors, "
        f"torch {torch.__version__}\n"
    )
    print("| | peak |\n| --- | --- |")
    for checkpointing in (False, True):
        training, evaluating = training_and_evaluation_peaks(
            batch=args.batch, eval_images=counts, grad_checkpointing=checkpointing, **size
        )
        with_gc = " with grad_checkpointing" if checkpointing else ""
        print(f"| training step, batch {args.batch}{with_gc} | {training / 2**30:.2f} GiB |")
    for n, peak in zip(counts, evaluating):
        print(f"| evaluation of {n} images | {peak / 2**30:.2f} GiB |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="image side (height), pixels")
    p.add_argument("--width", type=int, default=0, help="image width, pixels (0: --size)")
    p.add_argument("--evaluation", default="", help="N,...: evaluation's peak memory (above)")
    p.add_argument("--batch", type=int, default=8, help="images per batch")
    p.add_argument("--reps", type=int, default=3, help="timed steps per model, after a warm-up")
    args = p.parse_args()
    if args.evaluation:
        return print_peaks(args)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, NUM_CLASSES, (args.batch, args.size, args.size))
    rows = []
    for name, build in MODELS.items():
        saved, seconds = [], []
        for gc in (False, True):
            torch.manual_seed(0)
            model = build(gc).train()
            saved.append(saved_activation_bytes(model, x))
            seconds.append(step_seconds(model, x, target, args.reps))
        rows.append((name, *saved, *seconds))
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(
        f"batch {args.batch} x 3x{args.size}x{args.size}, fp32, CPU ({torch.get_num_threads()} "
        f"threads), torch {torch.__version__}; step: median of {args.reps}\n"
    )
    print("| model | saved for backward | with grad_checkpointing | ratio | step | with | slower |")
    print(f"|{'---|' * 7}")
    for name, plain, ckpt, t_plain, t_ckpt in rows:
        print(
            f"| {name} | {plain / 2**20:,.0f} MiB | {ckpt / 2**20:,.0f} MiB | {ckpt / plain:.2f} "
            f"| {t_plain:.2f} s | {t_ckpt:.2f} s | x{t_ckpt / t_plain:.2f} |"
        )


if __name__ == "__main__":
    main()
