"""How close a recipe's training loop runs to the compute bound, and to the classic tutorial loop.

    python scripts/bench.py                          # MNIST on data/mnist_sample, CPU or first GPU
    python scripts/bench.py --config recipes/configs/mnist_fast.yaml   # MNIST's fast preset
    python scripts/bench.py --reps 7 --json runs/bench/cpu.json
    python scripts/bench.py --dataset ylecun/mnist --steps 300   # full MNIST (hub or local cache)
    python scripts/bench.py --recipe unet            # U-Net on data/shapes: 6 minutes, 2 CPU cores
    python scripts/bench.py --recipe unet --also channels_last compile   # and the recipe with these
    python scripts/bench.py --recipe unet --dataset DIR --image_size 256 --batch_size 32  # real
    python scripts/bench.py --recipe unet --loader "" "--num_workers 4"  # the data path, no model
    python scripts/bench.py --recipe text --threads 1  # text on data/spam: 3 epochs of each variant
    python scripts/bench.py --tiny_model --steps 30 --startup_runs 0   # MNIST's host work per step
    python scripts/bench.py --recipe unet --quick    # the rows in seconds, and the full one's time
    accelerate launch --config_file accelerate_configs/bf16.yaml --num_processes 1 scripts/bench.py

One process trains the same model (the recipe's own class, optimizer, schedule, batch size and
settings, `--config` preset included, in the precision of the accelerate config) in three ways:

- recipe:  the recipe as users run it: its loaders, prepared by the Accelerator that
           common.accelerator.build_accelerator() builds, its optimizer and schedule, and its own
           train_one_epoch() with a common.progress.Progress.
- bound:   the same training step on batches that are already normalised floats on the device,
           a fixed list cycled: the compute bound, with no data path (and no augmentation) at all.
- classic: the tutorial loop on the same data, a few workers or none; the faster is compared.
           MNIST (pytorch/examples mnist): a Dataset that makes a PIL image per sample, ToTensor
           and Normalize per sample, a default DataLoader (shuffle), `.to(device)` per batch; 0
           and 1 workers. U-Net (milesial/Pytorch-UNet): a Dataset that opens the image and mask
           files with PIL per sample and converts them with numpy, a DataLoader with pin_memory,
           `.to(device, dtype)` per batch; 0 workers and the recipe's num_workers. Its AdamW uses
           the foreach kernels, as milesial's optimizer does; the recipe's and the bound's use
           the fused ones (recipes/unet.py make_optimizer).

A repetition is `--steps` optimizer steps (default: one full epoch of the train split, so the
recipe runs exactly as in training: no max_steps, hence no checkpoint inside the timed part), and
the recipe's run is as many epochs as the bench has repetitions (its schedule covers them all).
After `--warmup` repetitions of each, the variants take turns in rounds (recipe, bound, classic;
then bound, classic, recipe; ...) so that noise from other work on the machine hits all of them
alike. Reported: the median and the best repetition of each (on a busy machine the best is the
least disturbed one), and the median of the per-round ratios.
All share one torch thread count (`--threads`). Then the recipe is launched `--startup_runs`
times as a subprocess to time its start-up.

`--startup_cache` (MNIST) times only the start-up, from the end of the imports to the first
training step, on a datasets cache that starts empty: the first launch (the decoded images are
written to the cache), the second (they are read from it), and the second with
`--cache_decoded false` (decoded again, as before the cache).

`--tiny_model` (MNIST) trains one Linear layer (784 to 10) in place of BasicNet in every
variant: a step is then nearly all host work, as BasicNet's is on a GPU, so the recipe's host
work per step over the bound's shows as `recipe_minus_bound_us_per_step` (reported for every
run: the median over rounds of the two variants' seconds per step apart, in microseconds).

`--quick` gives the recipe, bound and classic rows (the classic loop without workers) in seconds
to a minute: QUICK_STEPS steps a repetition, one warm-up and one measured repetition of each, no
start-up launches (unless --steps, --reps or --startup_runs say otherwise); then the time that
the full bench would take here, from the seconds per step measured: each variant's warm-up and
repetitions of whole epochs, on top of this run's own set-up, the start-up launches apart.

`--also` (U-Net) adds the recipe with its `channels_last` setting and/or with the model
compiled as the accelerate config's `dynamo_backend: INDUCTOR` compiles it (torch.compile after
prepare()), to the same rounds; the report gives each one's speed over the plain recipe's.
Compiling happens in the warm-up repetition.

The U-Net bench also reports FLOP/s (bench_tools/flops.py): the FLOPs of training on one sample,
counted once at start; each variant's samples/s times that is its TFLOP/s, and its fraction of
the peak is that over the TFLOP/s of a large square matrix product in the run's precision, timed
before and after the rounds (the higher counts). `--image_size` and `--batch_size` set the
recipe's sizes: data from `scripts/make_shapes.py --size 256` at `--image_size 256 --batch_size
32` is training as it looks on a GPU.
`--loader FLAGS...` (U-Net) measures the data path alone instead: the images/s that the recipe's
training loader yields, built by load_data() and prepared as main() prepares it, with no model;
one variant per FLAGS, recipe settings over the defaults ("" for the defaults), in the same
interleaved rounds of whole epochs, after one warm-up epoch (which starts the workers).

Prints a table and writes JSON, and the table as markdown beside it (default
runs/bench/<recipe>.json, or runs/bench/<preset>.json with --config). Not a test: the figures
depend on the machine. The parts are in scripts/bench_tools/. Adding a recipe: write a
`bench_<name>(args, accelerator)` like bench_tools/mnist.py's and add it to RECIPES with its
defaults.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_tools/, beside this file

import torch  # noqa: E402
from bench_tools.flops import flop_rates, matmul_peak, peak_dtype, peak_name  # noqa: E402
from bench_tools.mnist import bench_mnist  # noqa: E402
from bench_tools.report import rate, write_report  # noqa: E402
from bench_tools.text import bench_text  # noqa: E402
from bench_tools.timing import (  # noqa: E402
    apart_per_step,
    device_name,
    measure,
    paired,
    time_from_imports,
    time_startup,  # noqa: E402
)
from bench_tools.unet import bench_loader, bench_unet  # noqa: E402

from common.accelerator import build_accelerator, close  # noqa: E402

# Each recipe's bench, and its defaults for what the command line leaves out. A U-Net step takes
# about 0.8 s on 2 CPU cores, so the U-Net measures 3 repetitions, not 7: 4 variants x (1 + 3)
# epochs of data/shapes (23 steps) take about 5 minutes there. Still whole epochs: a shorter
# repetition reaches its batches through skip_first_batches, whose new DataLoader starts new
# workers every repetition, and the first step after that fork takes about 2 s longer there
# (kernel time in the training process), a cost that training pays once, not every epoch.
RECIPES = {
    "mnist": (bench_mnist, {"dataset": "data/mnist_sample", "steps": 0, "reps": 7}),
    "unet": (bench_unet, {"dataset": "data/shapes", "steps": 0, "reps": 3}),
    # Text: whole epochs of data/spam, so that after the warm-up and 2 measured rounds every
    # variant has trained 3 epochs: their test accuracies compare at the same budget.
    "text": (bench_text, {"dataset": "data/spam", "steps": 0, "reps": 2}),
}
FULL_STARTUP_RUNS = 3  # the recipe launches a full bench times
# --quick: steps per repetition (a U-Net step is 0.1-1 s on 2 CPU cores), the one classic loop.
QUICK_STEPS = {"mnist": 20, "unet": 3}
QUICK = {"reps": 1, "startup_runs": 0}
QUICK_VARIANTS = ("recipe", "bound", "classic_w0", "classic")  # classic: text's


def full_bench_estimate(args, info, results, variants, elapsed):
    """The seconds that the bench without --quick would take here, start-up launches apart: this
    run's `elapsed` seconds (set-ups, warm-ups, its rounds), plus the steps that the full one
    runs beyond them (a warm-up and the recipe's default reps of whole epochs, for every variant
    in `variants`), each at the seconds per step that its variant measured (a classic loop with
    workers at the one without)."""
    reps, epoch = RECIPES[args.recipe][1]["reps"], info["steps_per_epoch"]
    per_step = {name: min(res["seconds"]) / info["steps_per_rep"] for name, res in results.items()}
    more = 0.0
    for name in variants:
        ran = (args.warmup + args.reps) * info["steps_per_rep"] if name in results else 0
        step = per_step.get(name, per_step.get("classic_w0", 0.0))
        more += max((args.warmup + reps) * epoch - ran, 0) * step
    return elapsed + more


def run_training(args, accelerator, bench, workdir):
    """The recipe, bound and classic variants in interleaved rounds, then the timed start-ups."""
    device = accelerator.device
    load_before = os.getloadavg()
    started = time.perf_counter()
    info, variants = bench(args, accelerator)
    every = list(variants)  # what the full bench runs
    if args.quick:
        kept = [*QUICK_VARIANTS, *(k for k in every if k.startswith("recipe_"))]  # and --also's
        variants = {k: v for k, v in variants.items() if k in kept}
    after = info.pop("after_rounds", None)  # a recipe's own figures once the rounds are done
    print(
        f"{args.recipe}{' ' + args.config if args.config else ''}: {info['steps_per_rep']} steps "
        f"= {info['samples_per_rep']} {info.get('unit', 'samples')} per repetition, "
        f"{args.warmup} warm-up + "
        f"{args.reps} measured each, interleaved, {args.threads} threads, {device.type} "
        f"({device_name(device)}), precision {accelerator.mixed_precision}",
        flush=True,
    )
    dynamo = accelerator.state.dynamo_plugin  # the accelerate config's dynamo_config
    if dynamo.backend.value != "NO":
        print(
            f"  prepare() compiles every model: backend {dynamo.backend.value.lower()}, "
            f"mode {dynamo.mode}",
            flush=True,
        )
    flops, dtype = info.get("flops_per_sample"), peak_dtype(accelerator)
    if flops:
        print(
            f"  {flops / 1e9:.1f} GFLOP per sample; timing a matrix product in "
            f"{peak_name(device, dtype)}",
            flush=True,
        )
        peaks = [matmul_peak(device, dtype)]
    results = measure(variants, device, args.warmup, args.reps)
    extra, extra_notes = after(results) if after else ({}, [])
    if flops:
        peaks.append(matmul_peak(device, dtype))  # again: the less disturbed of the two counts
    elapsed = time.perf_counter() - started
    startup = []
    if args.startup_runs:
        print(f"  launching the recipe {args.startup_runs} time(s) to time start-up", flush=True)
        startup = time_startup(
            info["startup_cmd"], info["startup_marker"], args.startup_runs, workdir
        )

    med = {name: res["median_samples_per_s"] for name, res in results.items()}
    best = {name: res["best_samples_per_s"] for name, res in results.items()}
    classic = max((n for n in med if n.startswith("classic")), key=med.get)
    report = {
        "recipe": args.recipe,
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "threads": args.threads,
        "precision": accelerator.mixed_precision,
        "torch_compile": dynamo.to_dict() if dynamo.backend.value != "NO" else None,
        **{k: v for k, v in info.items() if k != "startup_marker"},
        "warmup_reps": args.warmup,
        "reps": args.reps,
        "peak_memory_note": (
            "max CUDA memory allocated, from the variant's set-up through its warm-up"
            if device.type == "cuda"
            else "process RSS high-water mark after the variant's warm-up; variants "
            "run in one process in this order, so only the first (recipe) is its "
            "own"
        ),
        "variants": results,
        "classic_compared": classic,
        "recipe_over_bound": round(med["recipe"] / med["bound"], 3),
        "recipe_over_classic": round(med["recipe"] / med[classic], 3),
        # Per round: the variants of one round ran back to back, so they saw much the same load.
        "recipe_over_bound_paired": paired(results, "recipe", "bound"),
        "recipe_minus_bound_us_per_step": apart_per_step(
            results, "recipe", "bound", info["steps_per_rep"]
        ),
        "recipe_over_classic_paired": paired(results, "recipe", classic),
        # Other work on the machine only ever slows a repetition down, so the best repetition is
        # the least disturbed one.
        "recipe_over_bound_best": round(best["recipe"] / best["bound"], 3),
        "recipe_over_classic_best": round(
            best["recipe"] / max(v for n, v in best.items() if n.startswith("classic")), 3
        ),
        # --also: each variant's speed over the plain recipe's.
        "also_over_recipe": {
            name: {
                "ratio_of_medians": round(med[name] / med["recipe"], 3),
                "paired": paired(results, name, "recipe"),
            }
            for name in results
            if name.startswith("recipe_")
        },
        "load_average_1min": {
            "before": round(load_before[0], 2),
            "after": round(os.getloadavg()[0], 2),
            "cpu_cores": os.cpu_count(),
        },
        "startup_definition": (
            "seconds from launching `startup_cmd` to its start-up line "
            "(printed after the data is loaded and decoded, the model built and "
            "prepare() done: right before the first training step); to_exit_s: "
            "the whole 1-step smoke run, eval and writes included; exit_s: from "
            "its last output line to the process's exit"
        ),
        "startup": startup,
    }
    report.update(extra)
    if startup:
        report["startup_median_s"] = statistics.median(s["to_first_step_s"] for s in startup)
    if args.quick:
        report["quick_s"] = round(elapsed, 1)
        report["full_bench_estimate_s"] = round(
            full_bench_estimate(args, info, results, every, elapsed), 1
        )
    if flops:
        peak = flop_rates(results, flops, peaks)
        report["matmul_peak_tflops"] = {
            "precision": peak_name(device, dtype),
            "measured": [round(p, 4) for p in peaks],
            "used": round(peak, 4),
        }

    header = ["variant", "median/s", "best/s", "worst/s", "peak MB"]
    header += ["TFLOP/s", "of peak", "best"] if flops else []
    rows = []
    for name, res in results.items():
        row = [
            name,
            rate(res["median_samples_per_s"]),
            rate(res["best_samples_per_s"]),
            rate(min(res["samples_per_s"])),
            f"{res['peak_memory_mb']:.0f}",
        ]
        if flops:
            row += [
                f"{res['tflops']:.3g}",
                f"{res['fraction_of_peak']:.1%}",
                f"{res['fraction_of_peak_best']:.1%}",
            ]
        rows.append(row + [info["what"][name]])
    notes = [
        f"recipe/{other}: {report[f'recipe_over_{key}']:.3f} ratio of medians, "
        f"{report[f'recipe_over_{key}_paired']:.3f} median of per-round ratios, "
        f"{report[f'recipe_over_{key}_best']:.3f} ratio of best repetitions"
        for other, key in (
            ("bound", "bound"),
            (f"classic ({classic}, the faster median)", "classic"),
        )
    ]
    notes.append(
        f"recipe - bound: {report['recipe_minus_bound_us_per_step']:.0f} us per step, median of "
        f"per-round differences"
    )
    notes += [
        f"{name}/recipe: {ratio['ratio_of_medians']:.3f} ratio of medians, "
        f"{ratio['paired']:.3f} median of per-round ratios"
        for name, ratio in report["also_over_recipe"].items()
    ]
    notes += extra_notes
    load = report["load_average_1min"]
    notes.append(
        f"load average {load['before']} before, {load['after']} after, on {load['cpu_cores']} cores"
    )
    if startup:
        notes.append(
            f"start-up to first step {report['startup_median_s']:.2f} s (median of "
            f"{', '.join(str(s['to_first_step_s']) for s in startup)}); whole 1-step "
            f"smoke run {statistics.median(s['to_exit_s'] for s in startup):.2f} s, of "
            f"which exit after the last line "
            f"{statistics.median(s['exit_s'] for s in startup):.2f} s"
        )
    if flops:
        notes.append(
            f"{flops / 1e9:.1f} GFLOP per sample (forward + backward); matrix-product "
            f"peak {peak:.3g} TFLOP/s in {peak_name(device, dtype)}"
        )
    if args.quick:
        reps = RECIPES[args.recipe][1]["reps"]
        notes.append(
            f"quick: {report['quick_s']:.0f} s for {info['steps_per_rep']} steps a repetition; "
            f"the full bench ({len(every)} variants, 1 warm-up + {reps} repetitions of "
            f"{info['steps_per_epoch']} steps each, {FULL_STARTUP_RUNS} start-up launches) "
            f"would take about {report['full_bench_estimate_s'] / 60:.1f} min here, the "
            f"launches apart"
        )
    write_report(args.json, report, header + ["what"], rows, notes)


def run_loader(args, accelerator):
    """The U-Net's loader alone (bench_loader's variants), in interleaved rounds."""
    device = accelerator.device
    print(
        f"unet loader: {args.dataset}, {args.warmup} warm-up + {args.reps} measured epochs each, "
        f"interleaved, {args.threads} threads, {device.type} ({device_name(device)})",
        flush=True,
    )
    setups = {}

    def keep(name, setup):  # remember each variant's set-up time and data line
        def wrapped():
            rep = setup()
            setups[name] = {"setup_s": rep.setup_s, "data": rep.data}
            return rep

        return wrapped

    variants = bench_loader(args, accelerator)
    results = measure(
        {name: keep(name, setup) for name, setup in variants.items()},
        device,
        args.warmup,
        args.reps,
    )
    rows = []
    for name, res in results.items():
        res.update(setups[name])
        rows.append(
            [
                name,
                rate(res["median_samples_per_s"]),
                rate(res["best_samples_per_s"]),
                f"{res['setup_s']:.2f}",
                res["data"],
            ]
        )
    report = {
        "recipe": "unet",
        "mode": "loader",
        "dataset": args.dataset,
        "config": args.config,
        "device": device.type,
        "device_name": device_name(device),
        "threads": args.threads,
        "reps": args.reps,
        "variants": results,
    }
    notes = [f"load average {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} cores"]
    write_report(
        args.json,
        report,
        ["recipe flags", "images/s median", "best", "set-up s", "data"],
        rows,
        notes,
    )


STARTUP_RUNS = {  # label: (what it is, more recipe arguments)
    "first": ("first run: datasets converts the files, the recipe decodes and caches", []),
    "second": ("second run: the decoded images read from the cache", []),
    "second_no_cache": (
        "second run with --cache_decoded false: decoded again",
        ["--cache_decoded", "false"],
    ),
}


def run_startup_cache(args):
    """--startup_cache: start the recipe on args.dataset as in STARTUP_RUNS, one fresh process
    each, all on one datasets cache that starts empty (HF_DATASETS_CACHE in a temporary folder,
    removed after), and time each from the end of its imports to its first training step."""
    folder = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    print(
        f"{args.recipe} start-up on {args.dataset}, {os.cpu_count()} cores, from the end of the "
        f"imports to the first training step (3 launches; load average "
        f"{os.getloadavg()[0]:.2f})",
        flush=True,
    )
    preset = ["--config", args.config] if args.config else []
    runs = {}
    try:
        for label, (what, more) in STARTUP_RUNS.items():
            recipe_args = [
                "--dataset",
                args.dataset,
                *preset,
                "--smoke",
                "--smoke_steps",
                1,
                "--output_dir",
                folder / label,
                *more,
            ]
            cache = {"HF_DATASETS_CACHE": str(folder / "cache")}
            runs[label] = {"what": what, **time_from_imports(args.recipe, recipe_args, cache)}
            print(f"  {runs[label]['imports_done_to_first_step_s']:6.2f} s  {what}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {
        "recipe": args.recipe,
        "dataset": args.dataset,
        "config": args.config,
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "load_average_1min_after": round(os.getloadavg()[0], 2),
        "runs": runs,
    }
    rows = [
        [
            label,
            f"{run['imports_done_to_first_step_s']:.2f}",
            f"{run['launch_to_imports_done_s']:.2f}",
            run["what"],
        ]
        for label, run in runs.items()
    ]
    write_report(
        args.json,
        report,
        ["launch", "imports to first step s", "imports s", "what"],
        rows,
        [f"load average {report['load_average_1min_after']} after"],
    )


def main():
    per_recipe = "; ".join(
        f"{name}: " + ", ".join(f"--{k} {v}" for k, v in defaults.items())
        for name, (_, defaults) in RECIPES.items()
    )
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog=f"Defaults per recipe: {per_recipe}."
    )
    p.add_argument("--recipe", choices=sorted(RECIPES), default="mnist")
    p.add_argument("--dataset", help="what the recipe's --dataset takes (default: per recipe)")
    p.add_argument(
        "--config",
        help="a YAML file of recipe settings, as the recipe's --config "
        "takes (a preset: recipes/configs/mnist_fast.yaml)",
    )
    p.add_argument(
        "--steps",
        type=int,
        help="optimizer steps per repetition, the last of an epoch "
        "(0: one epoch; default: per recipe)",
    )
    p.add_argument(
        "--reps", type=int, help="measured repetitions of each variant (default: per recipe)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="repetitions of each variant before measuring"
    )
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads, all variants"
    )
    p.add_argument(
        "--startup_runs",
        type=int,
        help=f"recipe launches to time (0: skip; default {FULL_STARTUP_RUNS}, --quick 0)",
    )
    p.add_argument(
        "--json",
        help="where to write the results (default runs/bench/<recipe>.json, "
        "or <preset>.json with --config; the table beside it, .md)",
    )
    p.add_argument(
        "--loader",
        nargs="*",
        metavar="FLAGS",
        help="U-Net: measure the training loader alone, once per FLAGS (recipe "
        'settings, "" for the defaults), with no model (see above)',
    )
    p.add_argument(
        "--also",
        nargs="+",
        default=[],
        choices=["channels_last", "compile"],
        help="U-Net: also measure the recipe with channels_last, or compiled (see above)",
    )
    p.add_argument(
        "--image_size", help="U-Net: the recipe's image_size, SIZE or HxW (default: the recipe's)"
    )
    p.add_argument(
        "--batch_size", type=int, help="U-Net: the recipe's batch_size (default: the recipe's)"
    )
    p.add_argument(
        "--tiny_model",
        action="store_true",
        help="MNIST: one Linear layer in place of BasicNet: a step is nearly all host work",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="recipe, bound and classic rows of a few steps each, and the time the full bench "
        "takes (see above)",
    )
    p.add_argument(
        "--startup_cache",
        action="store_true",
        help="MNIST: only time start-up, a first and a second launch on an empty "
        "datasets cache (see above)",
    )
    args = p.parse_args()
    if args.quick and (args.loader is not None or args.startup_cache):
        p.error("--quick times the recipe, bound and classic rows: not --loader, --startup_cache")
    bench, defaults = RECIPES[args.recipe]
    if args.quick:  # what the command line leaves out, before the recipe's defaults
        defaults = {**defaults, "steps": QUICK_STEPS[args.recipe], **QUICK}
    for key, value in {"startup_runs": FULL_STARTUP_RUNS, **defaults}.items():  # the rest
        if getattr(args, key) is None:
            setattr(args, key, value)
    name = Path(args.config).stem if args.config else args.recipe
    mode = "-startup" if args.startup_cache else "_loader" if args.loader is not None else ""
    args.json = args.json or f"runs/bench/{name}{mode}.json"
    if args.startup_cache:
        if args.recipe != "mnist":
            p.error("--startup_cache is for --recipe mnist, the recipe with cache_decoded")
        return run_startup_cache(args)
    if min(args.steps, args.warmup, args.startup_runs) < 0 or min(args.reps, args.threads) < 1:
        p.error(
            "--steps, --warmup and --startup_runs cannot be negative; --reps and --threads "
            "must be at least 1"
        )
    sized = args.image_size is not None or args.batch_size is not None
    if (args.also or sized) and args.recipe != "unet":
        p.error("--also, --image_size and --batch_size are for --recipe unet")
    if args.tiny_model and args.recipe != "mnist":
        p.error("--tiny_model is for --recipe mnist")
    if args.loader is not None and args.recipe != "unet":
        p.error("--loader is for --recipe unet")

    args.loader = [""] if args.loader == [] else args.loader

    torch.set_num_threads(args.threads)
    accelerator = build_accelerator()
    if accelerator.num_processes != 1:
        raise SystemExit("error: the bench measures one process: launch it with --num_processes 1")
    workdir = tempfile.mkdtemp(prefix="bench-")
    args.workdir = str(Path(workdir) / "recipe")
    try:
        if args.loader:
            run_loader(args, accelerator)
        else:
            run_training(args, accelerator, bench, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    close(accelerator)


if __name__ == "__main__":
    main()
