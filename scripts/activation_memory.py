"""What grad_checkpointing saves and costs: activation memory and step time of the U-Nets.

    python scripts/activation_memory.py                   # batch 8 of 3x256x256, fp32, CPU
    python scripts/activation_memory.py --size 128 --batch 4 --reps 5

For each model (recipes/unet_model.py: the classic UNet at base_channels 64 and 16, ResNetUNet
with resnet34 at 16), without and with grad_checkpointing, one training forward pass is
measured: the bytes of the tensors that autograd keeps for backward, seen by
torch.autograd.graph.saved_tensors_hooks, each storage counted once (in-place ReLUs and views
share one) and the model's own parameters and buffers not counted (they are in memory anyway).
That is the activation memory held from the forward to the backward; with checkpointing, the
backward adds one level's activations at a time while it recomputes that level.
Then the seconds of one training step (forward, cross-entropy, backward), the median of --reps
after one warm-up step, so the cost of the recompute shows. Prints a markdown table.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "recipes")]  # common/ and the recipes' unet_model

import torch
import torch.nn.functional as F

from unet_model import ResNetUNet, UNet

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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="image side, pixels")
    p.add_argument("--batch", type=int, default=8, help="images per batch")
    p.add_argument("--reps", type=int, default=3, help="timed steps per model, after a warm-up")
    args = p.parse_args()
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
