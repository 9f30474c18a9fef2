"""What the tests share: the recipe launched as a user runs it, in this folder, on tiny data."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parents[1]  # the project: the recipe, common/, the configs
BIN = Path(sys.executable).parent


def launch(args, processes=1, timeout=600):
    """`python RECIPE.py ARGS` on 1 process, else `accelerate launch` with 2gpu.yaml (on a
    machine without GPUs: processes on the CPU over gloo); its output, after checking it ran."""
    args = [str(a) for a in args]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        config = HERE / "accelerate_configs" / "2gpu.yaml"
        cmd = [BIN / "accelerate", "launch", "--config_file", config]
        cmd += ["--num_processes", processes, "--main_process_port", free_port(), *args]
    # One thread a process: on a few cores, more slow these small models down.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, f"exit {res.returncode}: {' '.join(args)}\n{res.stdout[-4000:]}"
    return res.stdout


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(out):
    """The rows of out/metrics.jsonl: one an evaluation."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(a, b):
    """The two weights files hold the same tensors, bit for bit."""
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="session", autouse=True)
def _offline_cache(tmp_path_factory):
    """The tests' datasets cache in a temporary folder, and no reaching for the network."""
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a closed port: hub access fails at once
