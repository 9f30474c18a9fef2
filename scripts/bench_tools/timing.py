"""The clock: variants run in interleaved rounds, ratios paired by round, recipe launches timed."""

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench_tools import REPO
from bench_tools.report import rate
from common.metrics import peak_memory_mb


def sync(device):
    """Wait for queued GPU work, so that the clock measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def measure(variants, device, warmup, reps):
    """Set up and warm up each variant in turn, then run them round-robin, each round starting
    one variant later (so that none always follows the same one: the classic loop's worker
    exiting, say). variants: {name: setup}, setup() returns rep(), which runs one repetition and
    returns its sample count. Returns per-variant lists of samples/s and the peak memory read
    after the variant's warm-up (rep.peak_mb if the rep sets it)."""
    runs, results = {}, {}
    for name, setup in variants.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rep = setup()
        for _ in range(warmup):
            rep()
        sync(device)
        runs[name] = rep
        results[name] = {
            "samples_per_s": [],
            "seconds": [],
            "samples": [],
            "peak_memory_mb": getattr(rep, "peak_mb", None) or peak_memory_mb(device),
        }
    names = list(runs)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            samples = runs[name]()
            sync(device)
            seconds = time.perf_counter() - start
            res = results[name]
            res["samples"].append(samples)
            res["seconds"].append(round(seconds, 4))
            # 2 decimals: a U-Net on a CPU does ~10/s.
            res["samples_per_s"].append(round(samples / seconds, 2))
        print(
            f"  round {r + 1}/{reps}: "
            + ", ".join(f"{n} {rate(res['samples_per_s'][-1])}" for n, res in results.items()),
            flush=True,
        )
    for res in results.values():
        res["median_samples_per_s"] = statistics.median(res["samples_per_s"])
        res["best_samples_per_s"] = max(res["samples_per_s"])
    return results


def paired(results, a, b):
    """The median over rounds of a's samples/s over b's in the same round."""
    pairs = zip(results[a]["samples_per_s"], results[b]["samples_per_s"])
    return round(statistics.median(x / y for x, y in pairs), 3)


def apart_per_step(results, a, b, steps):
    """The median over rounds of a's seconds per step less b's in the same round, in us."""
    pairs = zip(results[a]["seconds"], results[b]["seconds"])
    return round(statistics.median((x - y) / steps * 1e6 for x, y in pairs), 1)


def read_into(stream, chunks):
    """Append everything `stream` gives until it closes to the list `chunks`."""
    chunks.append(stream.read())


def time_startup(cmd, marker, runs, workdir):
    """Launch the recipe `runs` times; return the seconds from launch to the first stdout line that
    starts with `marker`, and to the process's exit."""
    out = []
    for i in range(runs):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        full = cmd + ["--output_dir", str(Path(workdir) / f"startup-{i}")]
        start = time.perf_counter()
        proc = subprocess.Popen(
            full, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        stderr = []
        drain = threading.Thread(target=read_into, args=(proc.stderr, stderr))  # no deadlock
        drain.start()
        ready, lines, last = None, [], 0.0
        for line in proc.stdout:
            lines.append(line)
            last = time.perf_counter() - start
            if ready is None and line.startswith(marker):
                ready = last
        proc.wait()
        total = time.perf_counter() - start
        drain.join()
        if proc.returncode != 0 or ready is None:
            raise SystemExit(
                f"error: start-up run failed (exit {proc.returncode}, start-up line "
                f"{marker!r} {'seen' if ready else 'not seen'}): {' '.join(full)}\n"
                f"{''.join(lines)[-2000:]}{stderr[0][-2000:]}"
            )
        out.append(
            {
                "to_first_step_s": round(ready, 3),
                "to_exit_s": round(total, 3),
                "exit_s": round(total - last, 3),
            }
        )
    return out


# What a timed start-up from the imports runs: the recipe's imports, a line that marks their end,
# then the recipe as `python recipes/NAME.py ARGS` runs. The imports include two that come later
# in the recipe: datasets (imported to load the data) and torch._dynamo, which torch imports when
# the first optimizer is made, in any script (1-4 s on 2 busy CPU cores).
STARTUP_CHILD = """
import sys
sys.path.insert(0, {scripts!r})
import datasets, torch._dynamo
from bench_tools import load_recipe
recipe = load_recipe({name!r})
print("bench: imports done", flush=True)
sys.argv = [recipe.__file__, *sys.argv[1:]]
recipe.run(recipe.main, recipe.Config)
"""


def time_from_imports(name, args, env):
    """Run recipes/NAME.py ARGS once, as STARTUP_CHILD; return the seconds from launch to the end
    of its imports, and from there to its start-up line `NAME: ` (printed right before the first
    training step, after the data, the model and prepare())."""
    code = STARTUP_CHILD.format(scripts=str(REPO / "scripts"), name=name)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=REPO,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    seen, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        for key, prefix in (("imports", "bench: imports done"), ("ready", f"{name}: ")):
            if key not in seen and line.startswith(prefix):
                seen[key] = time.perf_counter() - start
    if proc.wait() != 0 or len(seen) != 2:
        raise SystemExit(
            f"error: start-up run failed (exit {proc.returncode}): recipes/{name}.py "
            f"{' '.join(map(str, args))}\n{''.join(lines)[-3000:]}"
        )
    return {
        "launch_to_imports_done_s": round(seen["imports"], 3),
        "imports_done_to_first_step_s": round(seen["ready"] - seen["imports"], 3),
    }
