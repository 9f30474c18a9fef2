"""How the U-Net's start-up grows with the number of image/mask pairs in its folders.

    python scripts/startup_bench.py                        # 500, 4,000 and 20,000 pairs
    python scripts/startup_bench.py --pairs 500,2000 --json runs/bench/startup.json

For each count N, a folder of N pairs is written (imgs/img_00000.png with
masks/img_00000_mask.png, as Carvana names them, each 32x32: the files are copies of one pair,
so that writing them costs little and every start-up step sees N files). Then, for each N:

- pairing:  common.pairs.folder_pairs() alone, in this process (the best of 3);
- first:    the recipe launched on the folders (--images, --masks, --smoke_steps 1) on a
            datasets cache that starts empty: the mask scan and decoding are done and cached;
- second:   the same launch again: the scan and the decoded images come from the cache.

Each launch is timed from the end of its imports to its start-up line (bench_tools.timing's
time_from_imports), right before the first training step. The last column divides each time by
the previous count's time over the counts' ratio: about 1 (or below) is linear growth, the
count's ratio (8 from 500 to 4,000) would be quadratic.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tools.report import write_report  # noqa: E402
from bench_tools.timing import time_from_imports  # noqa: E402

from common.segmentation.pairs import folder_pairs  # noqa: E402


def write_pairs(folder, count):
    """`count` pairs of 32x32 images and masks (2 classes) under folder/imgs and folder/masks."""
    rng = np.random.default_rng(0)
    (folder / "imgs").mkdir(parents=True)
    (folder / "masks").mkdir()
    image = folder / "image.png"
    mask = folder / "mask.png"
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    Image.fromarray(np.where(rng.random((32, 32)) < 0.5, 0, 255).astype(np.uint8)).save(mask)
    for i in range(count):
        shutil.copyfile(image, folder / "imgs" / f"img_{i:05d}.png")
        shutil.copyfile(mask, folder / "masks" / f"img_{i:05d}_mask.png")


def time_pairing(folder):
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        folder_pairs(folder / "imgs", folder / "masks")
        best = min(best, time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="500,4000,20000", help="the counts of pairs, a,b,c")
    p.add_argument("--json", default="runs/bench/startup.json", help="the report; a .md beside")
    args = p.parse_args()
    counts = [int(n) for n in args.pairs.split(",")]
    print(f"U-Net start-up against pairs, {os.cpu_count()} cores", flush=True)
    rows, runs, previous = [], [], None
    for count in counts:
        folder = Path(tempfile.mkdtemp(prefix=f"startup-{count}-"))
        try:
            write_pairs(folder, count)
            pairing = time_pairing(folder)
            recipe_args = [
                *("--images", folder / "imgs", "--masks", folder / "masks"),
                *("--base_channels", 8, "--num_workers", 0, "--smoke", "--smoke_steps", 1),
            ]
            cache = {"HF_DATASETS_CACHE": str(folder / "cache")}
            first, second = (
                time_from_imports(
                    "unet", [*recipe_args, "--output_dir", folder / f"run{i}"], cache
                )["imports_done_to_first_step_s"]
                for i in range(2)
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        run = {"pairs": count, "pairing_s": round(pairing, 4), "first_s": first, "second_s": second}
        growth = (
            "-"
            if previous is None
            else f"{(second / previous['second_s']) / (count / previous['pairs']):.2f}"
        )
        rows.append([count, f"{pairing:.3f}", f"{first:.2f}", f"{second:.2f}", growth])
        print("  " + "  ".join(str(c) for c in rows[-1]), flush=True)
        runs.append(run)
        previous = run
    write_report(
        args.json,
        {"cpu_cores": os.cpu_count(), "runs": runs},
        ["pairs", "pairing s", "first start s", "second start s", "second's growth / linear"],
        rows,
        [f"load average {os.getloadavg()[0]:.2f} after"],
    )


if __name__ == "__main__":
    main()
