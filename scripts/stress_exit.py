"""Run the 2-process smoke run many times in a row and count clean exits.

    python scripts/stress_exit.py --runs 20                       # accelerate launch
    python scripts/stress_exit.py --runs 20 --launcher torchrun
    python scripts/stress_exit.py --runs 20 --recipe recipes/unet.py --dataset data/shapes
    python scripts/stress_exit.py --runs 5 --recipe recipes/unet.py --dataset data/shapes \
        -- --base_channels 8
    python scripts/stress_exit.py --runs 20 --config_file my_compile.yaml   # your 2-process config

A clean exit is status 0 with no "terminate called" abort at interpreter shutdown: gloo's
threads dying because the DDP model or a prepared loader outlived the process group.
Not part of `make test`: 20 runs take a few minutes.
"""

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--launcher", choices=["accelerate", "torchrun"], default="accelerate")
    p.add_argument(
        "--config_file", default="accelerate_configs/2gpu.yaml", help="accelerate launch's config"
    )
    p.add_argument("--recipe", default="recipes/mnist.py")
    p.add_argument("--dataset", default="data/mnist_sample")
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument(
        "settings", nargs="*", help="more recipe settings, after --: -- --base_channels 8"
    )
    args = p.parse_args()

    clean = 0
    for i in range(1, args.runs + 1):
        if args.launcher == "accelerate":
            cmd = [
                BIN / "accelerate",
                "launch",
                "--config_file",
                args.config_file,
                "--num_processes",
                "2",
                "--main_process_port",
                str(free_port()),
            ]
        else:
            cmd = [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port())]
        out_dir = tempfile.mkdtemp(prefix="stress_exit_")  # a fresh run each time, not a resume
        cmd += [
            args.recipe,
            "--dataset",
            args.dataset,
            "--smoke",
            "--num_workers",
            str(args.num_workers),
            "--output_dir",
            out_dir,
            *args.settings,
        ]
        start = time.perf_counter()
        proc = subprocess.run(
            [str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=600
        )
        shutil.rmtree(out_dir)
        out = proc.stdout + proc.stderr
        ok = proc.returncode == 0 and "terminate called" not in out
        clean += ok
        print(
            f"run {i}: exit {proc.returncode}, {'clean' if ok else 'NOT CLEAN'}, "
            f"{time.perf_counter() - start:.1f}s",
            flush=True,
        )
        if not ok:
            print(out[-3000:])
    launcher = (
        f"accelerate launch --config_file {args.config_file}"
        if args.launcher == "accelerate"
        else "torchrun"
    )
    print(
        f"{clean}/{args.runs} clean exits ({launcher}, {args.recipe}, "
        f"num_workers {args.num_workers})"
    )
    sys.exit(0 if clean == args.runs else 1)


if __name__ == "__main__":
    main()
