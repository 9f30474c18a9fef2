"""The text recipe trained on other batches than its own: what a batch's make-up costs in accuracy.

    python scripts/studies/train_batches.py --batches by_class --seed 1  # then text.py's flags
    python scripts/studies/train_batches.py --batches per_octave=8 --model cnn --global_batch_size 0

Runs recipes/text.py as it is, with one change: the sizes by which its training sampler
(common.sampler.GlobalBucketSampler, with --global_batch_size 0) sorts the documents into
batches. The loader, the model, the loop and the padding are the recipe's (a batch is padded
to its longest document, as there):

- recipe:       the recipe's own sizes, the lengths rounded to 32 steps per doubling (the same
                run as `python recipes/text.py` with the same flags);
- per_octave=N: the lengths rounded to N steps per doubling: wider bands of tied lengths, whose
                documents meet other documents every epoch, at more padding;
- by_class:     each class sorted by length on its own, a document's size its place in its class
                (in as many steps as an epoch has batches), so that every batch holds the same
                slice of every class: the classes in the data's shares, at the padding of
                documents of unlike lengths side by side;
- shuffled:     every size the same: shuffled batches, each padded to its longest document, as
                the classic padded loop has them (with the recipe's loop around them).

scripts/studies/batch_mix.py shows these batches' padding and class mix without training.
"""

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes"), str(REPO)]
import text  # noqa: E402
from common.runtime import run  # noqa: E402
from common.sampler import rounded_lengths  # noqa: E402

CHOICES = "recipe, per_octave=N, by_class or shuffled"


def class_slices(lengths, labels, batch_size):
    """Sizes that sort each class by length on its own and interleave the classes: a document's
    size is its place in its class's order, in len // batch_size steps (times 8, from 8)."""
    lengths, labels = np.asarray(lengths), np.asarray(labels)
    steps = max(len(lengths) // batch_size, 1)
    sizes = np.zeros(len(lengths), np.int64)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        members = members[np.argsort(lengths[members], kind="stable")]
        sizes[members] = 8 * (np.arange(len(members)) * steps // len(members) + 1)
    return sizes


def sizes_for(batches, train_set, batch_size):
    """The training set's sizes for the sampler, for --batches."""
    if batches == "recipe":
        return train_set.sizes()
    if batches == "shuffled":
        return np.full(len(train_set), 8, np.int64)
    if batches == "by_class":
        return class_slices(train_set.lengths, train_set.labels.numpy(), batch_size)
    steps = batches.removeprefix("per_octave=")
    if steps.isdigit() and int(steps) >= 1 and int(steps) & (int(steps) - 1) == 0:
        return rounded_lengths(np.maximum(train_set.lengths, 1), per_octave=int(steps))
    raise SystemExit(f"error: --batches {batches}: give {CHOICES} (N a power of 2)")


def main():
    argv = sys.argv[1:]
    if "--batches" not in argv or argv.index("--batches") + 1 == len(argv):
        raise SystemExit(f"error: give --batches: {CHOICES}; then recipes/text.py's flags")
    at = argv.index("--batches")
    batches = argv.pop(at + 1)
    del argv[at]
    loader_by_length = text.train_loader_by_length

    def train_loader(train_set, **kwargs):
        sizes = sizes_for(batches, train_set, kwargs["batch_size"])
        train_set.sizes = lambda: sizes  # what train_loader_by_length hands the sampler
        print(f"batches: {batches}", flush=True)
        return loader_by_length(train_set, **kwargs)

    text.train_loader_by_length = train_loader  # main() calls it by this name
    run(text.main, text.Config, argv)


if __name__ == "__main__":
    main()
