"""The multi-node path, on one machine: two `accelerate launch` commands with num_machines 2,
machine_rank 0 and 1, and main_process_ip 127.0.0.1, one CPU process each, train together."""

import os
import subprocess

import pytest
from conftest import BIN, N_TEST, REPO, free_port, read_metrics


@pytest.mark.slow
def test_two_machines_train_as_one_job(tiny_mnist, tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = [
            BIN / "accelerate",
            "launch",
            "--config_file",
            "accelerate_configs/multinode.yaml",
            "--num_machines",
            2,
            "--num_processes",
            2,
            "--machine_rank",
            rank,
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--mixed_precision",
            "no",
            "recipes/mnist.py",
            "--dataset",
            tiny_mnist,
            "--output_dir",
            tmp_path,
            "--epochs",
            1,
            "--batch_size",
            32,
            "--eval_batch_size",
            64,
        ]
        procs.append(
            subprocess.Popen(
                [str(c) for c in cmd],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert "2 process(es) on cpu, gloo" in outputs[0]
    (row,) = read_metrics(tmp_path)  # written once, by the main process of machine 0
    assert row["world_size"] == 2 and row["eval_samples"] == N_TEST and row["step"] == 256 // 64
    # accelerator.print speaks once per machine: both machines report the same, global result.
    finals = [out.split("test accuracy ")[-1].split(";")[0] for out in outputs]
    assert finals[0] == finals[1] == f"{row['accuracy']:.4f} on {N_TEST} samples"
