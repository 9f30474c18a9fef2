"""The parts of scripts/bench.py, a file per job:

    timing.py    the clock: interleaved rounds of repetitions, paired ratios, timed launches
    loops.py     the three loops a variant runs: the recipe's epoch, the bound, the classic loop
    flops.py     FLOPs per sample, a matrix-product peak, TFLOP/s and the fraction of it
    mnist.py     the MNIST variants, built from recipes/mnist.py
    unet.py      the U-Net variants and its loader alone, built from recipes/unet.py
    report.py    the one report writer: the table on stdout, the same in markdown, the JSON

Importing it puts the repository root and recipes/ on sys.path, as running a recipe does, so
that `common` and the U-Net's helpers (unet_data) import.
"""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for path in (REPO / "recipes", REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from common.config import UserError, parse_config  # noqa: E402


def load_recipe(name):
    """recipes/NAME.py as a module: its Config, model, loaders, train_one_epoch, as users run it."""
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that inspect finds its source (--help reads the comments)
    spec.loader.exec_module(module)
    return module


def recipe_config(recipe, args, *flags):
    """The recipe's Config as its command line builds it: args.dataset, the YAML of args.config
    (a preset such as recipes/configs/mnist_fast.yaml), then `flags`. The run is as long as the
    bench's repetitions (each an epoch), so that a schedule planned over the epochs (OneCycleLR)
    covers them all, and it writes no checkpoint and stops at no max_steps. A bad setting stops
    with the recipe's one-line error."""
    argv = [
        "--dataset",
        args.dataset,
        "--output_dir",
        args.workdir,
        "--max_steps",
        "0",
        "--checkpoint_every_steps",
        "0",
        "--epochs",
        str(args.warmup + args.reps),
        *(["--config", args.config] if args.config else []),
        *flags,
    ]
    try:
        return parse_config(recipe.Config, argv)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
