"""How far batches by length lean to one class, against their padding: no training.

    python scripts/studies/batch_mix.py                  # data/spam (make data/spam), 8,192 bytes
    python scripts/studies/batch_mix.py --dataset DIR --max_length 2048 --pools 20,100

Reads the lengths in bytes of DIR/train/<class>/* (the text recipe's default input, cut at
max_length) and forms 3 epochs of batches of batch_size documents these ways:

- recipe:   the text recipe's sampler (common.sampler.GlobalBucketSampler, one process, the
            lengths rounded as the recipe rounds them: 32 steps per doubling, or --per_octave);
- pool K:   shuffled, cut into pools of K batches, each pool sorted by length, then cut into
            batches (a classic loop sorted within pools of 100);
- by class: each class sorted by length on its own, a batch the same slice of every class (as
            many batches as the others, so each holds the classes in the data's shares);
- shuffled: shuffled batches padded to their longest (the classic padded loop).

For each: the padding (share of the padded tokens), and the spread (standard deviation) over
batches of a batch's share of each class: shuffled batches show the binomial spread of batches
drawn at random; a larger spread is batches that hold more of one class than the data does.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from common.sampler import GlobalBucketSampler, rounded_lengths  # noqa: E402


def read_lengths(folder, max_length):
    """(lengths, labels, class names) of folder/train/<class>/*."""
    train = Path(folder) / "train"
    classes = sorted(p.name for p in train.iterdir() if p.is_dir()) if train.is_dir() else []
    if not classes:
        raise SystemExit(f"error: no class folders in {folder}/train: make data/spam writes them")
    lengths, labels = [], []
    for label, name in enumerate(classes):
        for path in (train / name).iterdir():
            lengths.append(min(path.stat().st_size, max_length or path.stat().st_size))
            labels.append(label)
    return np.array(lengths), np.array(labels), classes


def recipe_batches(lengths, batch_size, seed, epoch, per_octave):
    """One epoch of the recipe's batches (GlobalBucketSampler on one process): at most
    batch_size documents each, which the token budget never cuts further."""
    sizes = rounded_lengths(lengths, per_octave=per_octave)
    sampler = GlobalBucketSampler(
        sizes, batch_size * int(sizes.max()), seed=seed, max_batch_size=batch_size
    )
    sampler.set_epoch(epoch)
    return sampler.global_batches()


def pooled_batches(lengths, batch_size, pool, rng):
    """Shuffled, sorted by length within pools of `pool` batches (1: shuffled batches)."""
    order, sizes, batches = rng.permutation(len(lengths)), rounded_lengths(lengths), []
    for start in range(0, len(order), pool * batch_size):
        chunk = order[start : start + pool * batch_size]
        chunk = chunk[np.argsort(sizes[chunk], kind="stable")] if pool > 1 else chunk
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[j] for j in rng.permutation(len(batches))]


def by_class_batches(lengths, labels, batch_size, rng):
    """Each class shuffled, sorted by length, and cut into as many runs as there are batches;
    batch i holds run i of every class."""
    count, sizes, runs = -(-len(lengths) // batch_size), rounded_lengths(lengths), []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        runs.append(np.array_split(members[np.argsort(sizes[members], kind="stable")], count))
    batches = [np.concatenate([r[i] for r in runs]) for i in range(count)]
    return [batches[j] for j in rng.permutation(count)]


def measure(epochs, lengths, labels, classes):
    """(padding, spread of each class's share of a batch) over the epochs' batches."""
    batches = [np.asarray(b) for epoch in epochs for b in epoch]
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    spread = [np.std([np.mean(labels[b] == c) for b in batches]) for c in range(len(classes))]
    return 1 - real / padded, spread


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="data/spam")
    p.add_argument("--max_length", type=int, default=8192, help="bytes kept of a document")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--pools", default="100,20,5", help="pool sizes K, in batches")
    p.add_argument("--per_octave", type=int, default=32, help="the recipe's rounding of lengths")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lengths, labels, classes = read_lengths(args.dataset, args.max_length)
    shares = ", ".join(f"{name} {np.mean(labels == c):.3f}" for c, name in enumerate(classes))
    print(f"{len(lengths)} training documents ({shares}), cut at {args.max_length} bytes")
    rng = np.random.default_rng(args.seed)
    rows = {
        "recipe": [
            recipe_batches(lengths, args.batch_size, args.seed, epoch, args.per_octave)
            for epoch in range(args.epochs)
        ]
    }
    for pool in [int(k) for k in args.pools.split(",")]:
        rows[f"pool {pool}"] = [
            pooled_batches(lengths, args.batch_size, pool, rng) for _ in range(args.epochs)
        ]
    rows["by class"] = [
        by_class_batches(lengths, labels, args.batch_size, rng) for _ in range(args.epochs)
    ]
    rows["shuffled"] = [
        pooled_batches(lengths, args.batch_size, 1, rng) for _ in range(args.epochs)
    ]
    print(f"{'batches':10} {'padding':>8}  spread of a batch's share of " + ", ".join(classes))
    for name, epochs in rows.items():
        padding, spread = measure(epochs, lengths, labels, classes)
        print(f"{name:10} {padding:8.1%}  " + ", ".join(f"{s:.3f}" for s in spread))


if __name__ == "__main__":
    main()
