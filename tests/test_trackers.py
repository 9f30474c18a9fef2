"""Experiment trackers, and the logs of a resumed run: TensorBoard's curves, the wandb run and
metrics.jsonl go on from the checkpoint, without the points and lines that the run writes again.
The TensorBoard scalars of a 2-process MNIST run are read back in test_ema_and_early_stop.py (its
early-stopping run), the U-Net's panels in test_unet_training.py."""

import json
import os
import re
import shutil
import signal
import sys

import pytest
from conftest import assert_ok, launch, read_metrics, run_here, start, wait_for

from common.config import UserError
from common.metrics import drop_lines_after

RECIPE = "recipes/mnist.py"
# 256 train samples, batch 32: 8 optimizer steps an epoch.
SMALL = ["--batch_size", 32, "--eval_batch_size", 256]


def steps_logged(folder):
    """{tag: [step, ...]} of the TensorBoard scalars in `folder`, as TensorBoard shows them: its
    EventAccumulator reads the event files in order and applies each writer's purge_step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def kill_when(args, done, log):
    """Run `python RECIPE args` as launch() does and SIGKILL it, as a crash or a lost machine
    would, as soon as done() is true; its output goes to `log`."""
    with open(log, "w") as out:
        proc = start([sys.executable, *args], {"ACCELERATE_USE_CPU": "1"}, stdout=out)
        try:
            wait_for(done, proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]


def test_a_resumed_run_drops_the_lines_it_writes_again_and_keeps_the_rest(tmp_path):
    # In-process: which lines go (the wiring, a launch resuming with the lines of later steps in
    # the file: test_resume.py's bit-exact resume; a partial epoch's line launched: below, slow).
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"epoch": 1, "step": 8},
        {"epoch": None, "step": 8},  # an eval_only run of the epoch-1 weights
        {"epoch": 2, "step": 13},  # a partial epoch, max_steps stopped it at the checkpoint
        {"epoch": None, "step": 13},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"epoch": 3, "st')
    drop_lines_after(path, step=13, epoch=2)  # resumes in epoch 2, at step 13
    assert [(r["epoch"], r["step"]) for r in read_metrics(tmp_path)] == [
        (1, 8),
        (None, 8),
        (None, 13),
    ]
    drop_lines_after(path, step=10, epoch=2)  # a checkpoint before them: the later lines go
    assert [(r["epoch"], r["step"]) for r in read_metrics(tmp_path)] == [(1, 8), (None, 8)]
    drop_lines_after(path, step=8, epoch=2)  # an epoch's end: its lines stay
    assert [(r["epoch"], r["step"]) for r in read_metrics(tmp_path)] == [(1, 8), (None, 8)]
    path.write_text("not json\n")
    with pytest.raises(UserError, match=re.escape(f"{path} line 1 is not JSON: fix or remove it")):
        drop_lines_after(path, step=8, epoch=2)
    drop_lines_after(path, step=0, epoch=1)  # a run that starts afresh: every line goes
    assert not path.exists()


@pytest.mark.slow
def test_a_partial_epochs_metrics_line_goes_when_the_run_resumes(
    tiny_mnist, mnist_checkpoint, tmp_path
):
    # mnist_checkpoint stopped at step 13 by max_steps: a line for its partial epoch 2. Going on
    # to the end of epoch 2 writes epoch 2's line again, so the partial one goes.
    run = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    # Other tests add eval_only lines (epoch null) to the shared run: they stay.
    assert [(r["epoch"], r["step"]) for r in read_metrics(run) if r["epoch"]] == [(1, 8), (2, 13)]
    res = launch(
        [RECIPE, "--dataset", tiny_mnist, "--output_dir", run, *SMALL, "--max_steps", 16]
        + ["--resume", "latest"],
        launcher="python",
    )
    assert_ok(res)
    assert "(epoch 2, step 13)" in res.output
    assert [(r["epoch"], r["step"]) for r in read_metrics(run) if r["epoch"]] == [(1, 8), (2, 16)]


@pytest.mark.slow
def test_a_killed_run_resumes_with_curves_that_do_not_double_back_and_one_line_an_epoch(
    tiny_mnist, tmp_path
):
    out = tmp_path / "run"
    args = [RECIPE, "--dataset", tiny_mnist, "--output_dir", out, *SMALL, "--epochs", 3]
    args += ["--log_with", "tensorboard", "--log_every", 1]
    args += ["--checkpoint_every_steps", 4, "--keep_checkpoints", 10]
    # Killed once step-12 is written: by then it has logged steps 1..12 and evaluated epoch 1.
    kill_when(args, (out / "checkpoints" / "step-00000012").is_dir, tmp_path / "killed.log")
    # Go back to step 4, as if the kill had come just before the step-8 checkpoint. What the killed
    # run logged after step 4 is logged again by the resumed run: the test holds only if it goes.
    for checkpoint in (out / "checkpoints").glob("step-*"):
        if checkpoint.name != "step-00000004":
            shutil.rmtree(checkpoint)
    before = steps_logged(out / "mnist")
    assert before["train/loss"][:12] == list(range(1, 13)) and before["eval/accuracy"][0] == 8
    assert read_metrics(out)[0]["step"] == 8

    res = launch([*args, "--resume", out / "checkpoints" / "step-00000004"], launcher="python")
    assert_ok(res)
    assert "(epoch 1, step 4)" in res.output
    after = steps_logged(out / "mnist")
    assert {"train/loss", "train/lr", "eval/accuracy", "eval/eval_loss"} <= after.keys()
    for tag, steps in after.items():  # each point once, in order: the curves never double back
        assert steps == (list(range(1, 25)) if tag.startswith("train/") else [8, 16, 24]), tag
    assert [(r["epoch"], r["step"]) for r in read_metrics(out)] == [(1, 8), (2, 16), (3, 24)]


@pytest.mark.slow
def test_a_resumed_run_goes_on_logging_into_the_same_wandb_run(tiny_mnist, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # runs saved in output_dir/wandb/
    args = [RECIPE, "--dataset", tiny_mnist, "--output_dir", tmp_path, *SMALL, "--epochs", 1]
    args += ["--log_with", "wandb", "--log_every", 2]
    assert_ok(launch([*args, "--max_steps", 4], launcher="python", env=env, timeout=120))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    res = launch([*args, "--resume", "latest"], launcher="python", env=env, timeout=120)
    assert_ok(res)
    assert "(epoch 1, step 4)" in res.output
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs


@pytest.mark.slow
def test_a_missing_tracker_package_is_one_line(tiny_mnist, tmp_path, monkeypatch, capsys):
    # wandb is installed (requirements-extras.txt): here it is made not to be found, and the
    # recipe runs as `python recipes/mnist.py` runs it (run(), in this process).
    from recipe_module import load_recipe

    monkeypatch.setitem(sys.modules, "wandb", None)  # what a missing package looks like
    mnist = load_recipe("mnist")
    argv = ["--dataset", str(tiny_mnist), "--output_dir", str(tmp_path / "run")]
    assert run_here(mnist, [*argv, "--log_with", "wandb"]) == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.splitlines() == [
        "error: log_with wandb needs the wandb package: pip install -r requirements-extras.txt"
    ]
