"""Faults that must lose nothing: Ctrl-C and SIGTERM with DataLoader workers under every launcher,
a full disk, a second run into the same folder, a mistyped --resume folder.

Signals are sent as a terminal sends them: the run starts in a session of its own with SIGINT at
its default disposition, and Ctrl-C goes to its whole process group, DataLoader workers included.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, REPO, assert_ok, free_port, launch, run_here
from safetensors.torch import load_file

UNET_ARGS = [
    "--base_channels",
    8,
    "--lr",
    3e-3,
    "--val_fraction",
    0.2,
    "--eval_batch_size",
    4,
    "--batch_size",
    8,
    "--num_workers",
    2,
    "--epochs",
    40,
]
MNIST_ARGS = [
    "--batch_size",
    32,
    "--eval_batch_size",
    512,
    "--num_workers",
    2,
    "--data_on_device",
    "false",
    "--epochs",
    200,
]


def command(launcher, nproc, args):
    if launcher == "python":
        return [sys.executable, *args]
    if launcher == "accelerate":
        config = "cpu.yaml" if nproc == 1 else "2gpu.yaml"
        return [
            BIN / "accelerate",
            "launch",
            "--config_file",
            REPO / "accelerate_configs" / config,
            "--num_processes",
            nproc,
            "--main_process_port",
            free_port(),
            *args,
        ]
    return [BIN / "torchrun", "--nproc_per_node", nproc, "--master_port", free_port(), *args]


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a job started from a script may have it ignored


def interrupt(cmd, out_dir, sig, to_group, env=None, in_first_epoch=False):
    """Start cmd, wait until its first epoch is evaluated (the DataLoader workers are running),
    or with in_first_epoch until 2 s after its start-up line, then send `sig` to its process
    group (a terminal's Ctrl-C) or to the launcher alone, and return (exit status, output)."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
    )
    try:
        deadline, head = time.time() + 240, ""
        while in_first_epoch and "process(es) on" not in head:
            line = proc.stdout.readline()
            assert line and time.time() < deadline, f"no start-up line: {head[-3000:]}"
            head += line
        time.sleep(2 if in_first_epoch else 0)
        while not (in_first_epoch or (Path(out_dir) / "metrics.jsonl").exists()):
            assert proc.poll() is None, f"exited early: {proc.stdout.read()[-3000:]}"
            assert time.time() < deadline, "no epoch finished in time"
            time.sleep(0.2)
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, head + out


def stopped_step(out, out_dir, nproc):
    """The step the run stopped at, after checking that it said so and checkpointed on every
    rank."""
    assert (
        "stopped at step" in out
        and "exited unexpectedly" not in out
        and "killed by signal" not in out
    ), out[-3000:]
    assert "terminate called" not in out, out[-3000:]
    step = int(out.split("stopped at step ")[1].split(";")[0])
    checkpoint = Path(out_dir) / "checkpoints" / f"step-{step:08d}"
    for rank in range(nproc):
        assert (checkpoint / f"random_states_{rank}.pkl").is_file(), sorted(
            Path(out_dir).rglob("*")
        )
    return step


def assert_same_weights(a, b):
    wa, wb = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("launcher, nproc", [("python", 1), ("accelerate", 2)])
def test_ctrl_c_with_dataloader_workers_checkpoints_and_resumes_bit_exactly(
    shapes, tmp_path, launcher, nproc
):
    args = ["recipes/unet.py", "--dataset", shapes, *UNET_ARGS]
    split, straight = tmp_path / "split", tmp_path / "straight"
    code, out = interrupt(
        command(launcher, nproc, [*args, "--output_dir", split]), split, signal.SIGINT, True
    )
    step = stopped_step(out, split, nproc)
    # python exits 130 (128 + SIGINT); a launcher reports its own status after the recipe's line,
    # which says so (docs/errors.md).
    assert code == (130 if launcher == "python" else 1), out[-3000:]
    line = f"stopped at step {step}; continue with --resume latest"
    if launcher == "python":
        assert f"{line}\n" in out, out[-3000:]
    else:
        note = f"{line} (accelerate launch's traceback below reports this stop: nothing else"
        assert note in out and out.index(note) < out.rindex("Traceback"), out[-3000:]
    if launcher == "python":
        # The stop's checkpoint is written as every checkpoint is (Progress.checkpoint_due), and
        # resumes bit-exactly: on 2 processes below, and in test_unet_training.py's fast tier.
        return
    env = {"OMP_NUM_THREADS": "1"}
    res = launch(
        [*args, "--output_dir", split, "--resume", "latest", "--max_steps", step + 5],
        nproc=nproc,
        env=env,
    )
    assert_ok(res)
    assert f"step {step})" in res.output
    assert_ok(
        launch([*args, "--output_dir", straight, "--max_steps", step + 5], nproc=nproc, env=env)
    )
    assert_same_weights(split, straight)


@pytest.mark.slow
def test_sigterm_to_torchrun_with_dataloader_workers_checkpoints_every_rank(tiny_mnist, tmp_path):
    # SIGTERM to torchrun alone, as a scheduler stops a job: torchrun passes it on to each rank,
    # which checkpoints (stopped_step). Resuming under torchrun: test_resume.py.
    args = ["recipes/mnist.py", "--dataset", tiny_mnist, *MNIST_ARGS]
    code, out = interrupt(
        command("torchrun", 2, [*args, "--output_dir", tmp_path]),
        tmp_path,
        signal.SIGTERM,
        to_group=False,
    )
    step = stopped_step(out, tmp_path, 2)
    assert code == 1
    state = json.loads(
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").read_text()
    )
    assert state["step"] == step and state["world_size"] == 2


@pytest.mark.slow
def test_ctrl_c_in_the_first_epoch_under_the_single_process_launcher_with_workers(tmp_path):
    # The shipped sample: 125 steps an epoch, so Ctrl-C lands in epoch 1, whose workers start
    # before the first step.
    args = [
        "recipes/mnist.py",
        "--dataset",
        "data/mnist_sample",
        *MNIST_ARGS,
        "--output_dir",
        tmp_path,
    ]
    code, out = interrupt(
        command("accelerate", 1, args), tmp_path, signal.SIGINT, to_group=True, in_first_epoch=True
    )
    assert stopped_step(out, tmp_path, 1) < 125 and not (tmp_path / "metrics.jsonl").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MB tmpfs: room for one MNIST checkpoint (about 14 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(
    tiny_mnist, small_disk, tmp_path
):
    out = small_disk / "run"
    res = launch(
        [
            "recipes/mnist.py",
            "--dataset",
            tiny_mnist,
            "--output_dir",
            out,
            "--batch_size",
            32,
            "--checkpoint_every_steps",
            2,
            "--epochs",
            1,
        ],
        nproc=2,
    )
    errors = [line for line in res.output.splitlines() if line.startswith("error")]
    assert res.returncode != 0 and len(errors) == 1, res
    assert errors[0].startswith(
        f"error: cannot write {out / 'checkpoints' / 'step-00000004'} (No space left on device"
    )
    assert f"--resume latest goes on from {out / 'checkpoints' / 'step-00000002'}" in errors[0]
    assert "Traceback" not in res.output.split("error: cannot write")[0], (
        res
    )  # later lines: the launcher's
    # The earlier checkpoint is whole (each of its files reads), and nothing temporary is left:
    # --resume latest goes on from it, as from any checkpoint (test_resume.py).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    checkpoint = out / "checkpoints" / "step-00000002"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2
    assert "fc2.weight" in load_file(checkpoint / "model.safetensors")
    assert torch.load(checkpoint / "optimizer.bin", weights_only=True)["state"]
    for rank in (0, 1):
        assert torch.load(checkpoint / f"random_states_{rank}.pkl", weights_only=False)


def open_here(output_dir, *more):
    """open_run() of an MNIST run into output_dir, in this process, as main() opens it: (its
    output folder, checkpoint), with the lock on the folder let go again."""
    from recipe_module import load_recipe

    from common import outputs
    from common.accelerator import build_accelerator
    from common.config import parse_config

    mnist = load_recipe("mnist")
    cfg = parse_config(mnist.Config, ["--output_dir", str(output_dir), *map(str, more)])
    held = len(outputs._locks)
    try:
        return outputs.open_run(build_accelerator(), cfg)
    finally:
        while len(outputs._locks) > held:  # a run's process holds it until it ends
            outputs._locks.pop().close()


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_stops_at_once(tiny_mnist, tmp_path):
    from common.config import UserError

    args = [
        sys.executable,
        "recipes/mnist.py",
        "--dataset",
        tiny_mnist,
        "--output_dir",
        tmp_path,
        "--batch_size",
        32,
        "--epochs",
        200,
        "--num_workers",
        2,
        "--data_on_device",
        "false",
    ]
    first = subprocess.Popen(
        [str(a) for a in args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not (tmp_path / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.2)
        # What a second run's main() meets first: open_run, here; its one line and exit status 2
        # are those of every user error (test_config.py launches one).
        with pytest.raises(UserError) as e:
            open_here(tmp_path, "--resume", "latest")
        assert str(e.value).startswith(
            f"output_dir {tmp_path} is in use by a run that is still going (process {first.pid} on "
        ), e.value
        # A crash of the training process alone: its DataLoader workers (started after the lock
        # was taken) may live a moment longer, and must not hold the lock.
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        out, _ = open_here(tmp_path, "--resume", "latest")  # not "in use"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert out == tmp_path


@pytest.mark.slow
def test_resume_latest_into_a_folder_that_does_not_exist_is_an_error(tmp_path):
    from common.config import UserError

    with pytest.raises(UserError) as e:
        open_here(tmp_path / "typo", "--resume", "latest")
    assert str(e.value) == (
        f"resume latest: output_dir {tmp_path / 'typo'} does not exist: check --output_dir, "
        f"or leave out --resume to start a new run"
    )
    assert not (tmp_path / "typo").exists()


@pytest.mark.slow
def test_a_run_that_fails_before_training_leaves_no_folder(tmp_path):
    # run(), as `python recipes/mnist.py` calls it: exit status 2 after the one line
    # (test_config.py launches it), and the folder that this run made, untrained, goes.
    from recipe_module import load_recipe

    mnist = load_recipe("mnist")
    (tmp_path / "mine").mkdir()  # a folder the user made is theirs: it stays
    for folder in ("new", "mine"):
        argv = ["--dataset", "./nowhere", "--output_dir", str(tmp_path / folder)]
        assert run_here(mnist, argv) == 2
    assert not (tmp_path / "new").exists() and (tmp_path / "mine").is_dir()
