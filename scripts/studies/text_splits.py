"""The text recipe and the TF-IDF baselines over k splits of one corpus: how far a split moves them.

    python scripts/studies/text_splits.py --dataset data/manpages --workdir runs/splits
    python scripts/studies/text_splits.py --dataset DIR --workdir W --folds 5 -- --model cnn

The corpus is one folder per class (DIR/<class>/*), as the recipe splits it itself: by a hash of
each document's bytes (content_split). Split i of k holds out the documents whose hash falls in
the i-th k-th of its range, so that every document is held out once; split 0 of 5 is the
recipe's own split (val_fraction 0.2). Each split is a folder of links to the documents,
WORKDIR/split<i>/train/<class>/ and .../test/<class>/. On each, the recipe runs as a user runs it
(`python recipes/text.py --dataset WORKDIR/split<i>`, with the flags after `--`), then the
benchmark's TF-IDF baselines on the same split, each document cut as the recipe cuts it
(scripts/bench_tools/text.py). Prints a line per split and the means.
"""

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
from bench_tools import load_recipe  # noqa: E402
from bench_tools.text import BASELINES, linear_baselines  # noqa: E402

from common.config import parse_config  # noqa: E402


def share(path):
    """Where the document's hash falls in its range, in [0, 1): content_split's number."""
    return int.from_bytes(hashlib.sha256(path.read_bytes()).digest()[:8], "big") / 2**64


def write_splits(dataset, workdir, folds):
    """WORKDIR/split<i>/{train,test}/<class>/<file>: links to DATASET/<class>/<file>."""
    files = sorted(f for f in Path(dataset).glob("*/*") if f.is_file())
    if not files:
        raise SystemExit(f"error: {dataset} holds no <class>/<file>: give one folder per class")
    roots = [Path(workdir) / f"split{i}" for i in range(folds)]
    for f in files:
        held = int(share(f) * folds)
        for i, root in enumerate(roots):
            side = root / ("test" if i == held else "train") / f.parent.name
            side.mkdir(parents=True, exist_ok=True)
            (side / f.name).symlink_to(f.resolve())
    return roots


def recipe_accuracy(root, flags):
    """The recipe's test accuracy on one split (its output in WORKDIR/run<i>, beside the split:
    inside, it would be a folder of the dataset), read from its metrics.jsonl."""
    out = root.with_name(root.name.replace("split", "run"))
    cmd = [sys.executable, str(REPO / "recipes" / "text.py"), "--dataset", str(root)]
    cmd += ["--output_dir", str(out), "--keep_checkpoints", "1", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"error: the recipe stopped on {root}:\n{res.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["accuracy"] for r in rows if "accuracy" in r][-1]  # after the last epoch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="one folder per class: DIR/<class>/*")
    p.add_argument("--workdir", required=True, help="a new folder for the splits and the runs")
    p.add_argument("--folds", type=int, default=5, help="the number of splits, 2 at least")
    p.add_argument("flags", nargs="*", help="after --: recipes/text.py's flags for every run")
    args = p.parse_args()
    if args.folds < 2 or Path(args.workdir).exists():
        raise SystemExit("error: --folds must be 2 or more and --workdir a folder not there yet")
    text = load_recipe("text")
    found = {"recipe": [], **{name: [] for name in BASELINES}}
    for i, root in enumerate(write_splits(args.dataset, args.workdir, args.folds)):
        found["recipe"].append(recipe_accuracy(root, args.flags))
        cfg = parse_config(text.Config, ["--dataset", str(root), *args.flags])  # the same cut
        for name, result in linear_baselines(text, cfg).items():
            found[name].append(result["accuracy"])
        print(f"split {i}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in found.items()), flush=True)
    print("mean: " + ", ".join(f"{k} {sum(v) / len(v):.4f}" for k, v in found.items()))


if __name__ == "__main__":
    main()
