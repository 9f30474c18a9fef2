"""Run each recipe briefly in fp32, fp16 and bf16 on one GPU and print a table.

    python scripts/gpu_check.py                  # or: make gpu-check
    python scripts/gpu_check.py --recipes mnist --epochs 5

Each run is a real `accelerate launch` of the recipe with accelerate_configs/1gpu.yaml and
`--mixed_precision` set; the figures come from the run's own metrics.jsonl:
samples/s (median over the epochs after the first, which includes warm-up), peak GPU memory,
the last train loss and test metric, and how many optimizer steps fp16's gradient scaler
skipped (a few at the start are normal: the scale starts high and backs off).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = {"mnist": ["--dataset", "data/mnist_sample"], "unet": ["--dataset", "data/shapes"]}
METRIC = {"mnist": "accuracy", "unet": "dice"}


def run(recipe, precision, epochs, out):
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/1gpu.yaml",
        "--mixed_precision",
        precision,
        f"recipes/{recipe}.py",
        *DATA[recipe],
        "--epochs",
        str(epochs),
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["train_samples_per_s"] for r in rows[1:]] or [rows[0]["train_samples_per_s"]]
    return {
        "recipe": recipe,
        "precision": precision,
        "epochs": len(rows),
        "samples_per_s": statistics.median(speeds),
        "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
        "train_loss": rows[-1]["train_loss"],
        "metric": METRIC[recipe],
        "value": rows[-1][METRIC[recipe]],
        "skipped_steps": sum(r.get("skipped_steps", 0) for r in rows),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["mnist", "unet"], choices=sorted(DATA))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="runs/gpu-check")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: gpu-check needs a CUDA GPU and none is visible")
    results = []
    for recipe in args.recipes:
        for precision in ("no", "fp16", "bf16"):
            results.append(
                run(recipe, precision, args.epochs, REPO / args.out / f"{recipe}-{precision}")
            )
            r = results[-1]
            print(
                f"{r['recipe']:6} {r['precision']:5} {r['samples_per_s']:10.0f} samples/s "
                f"{r['peak_memory_mb']:8.0f} MB  loss {r['train_loss']:.4f}  "
                f"{r['metric']} {r['value']:.4f}  skipped {r['skipped_steps']}",
                flush=True,
            )
    header = "| recipe | precision | samples/s | peak MB | train loss | metric | skipped steps |"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n{header}\n|{'---|' * 7}")
    for r in results:
        print(
            f"| {r['recipe']} | {r['precision']} | {r['samples_per_s']:.0f} | "
            f"{r['peak_memory_mb']:.0f} | {r['train_loss']:.4f} | "
            f"{r['metric']} {r['value']:.4f} | {r['skipped_steps']} |"
        )
    (REPO / args.out / "gpu_check.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
