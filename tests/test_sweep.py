"""scripts/sweep.py: Optuna studies whose trials are real launches of a recipe. A sweep is
pruned, stopped with Ctrl-C and continued; a killed sweep's trial is taken over; two sweep
processes share one study."""

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import start, wait_for

import scripts.sweep as sweep

EPOCHS = 3


def sweep_command(data, out, *more, trials=3, epochs=EPOCHS):
    """A sweep over MNIST on tiny_mnist (8 steps an epoch)."""
    return [
        sys.executable,
        "scripts/sweep.py",
        "--study",
        "tiny",
        "--out",
        out,
        "--trials",
        trials,
        "--poll_s",
        0.05,
        *more,
        "--",
        "recipes/mnist.py",
        "--dataset",
        data,
        "--epochs",
        epochs,
        "--batch_size",
        32,
        "--eval_batch_size",
        512,
    ]


def start_sweep(command, threads=None):
    """The sweep as a terminal starts it (conftest.start). threads: torch's in each trial (1: a
    model this small gains nothing from a second, and two trials at once on 2 cores would fight
    over them); None: accelerate's choice."""
    env = {"ACCELERATE_USE_CPU": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return start(command, env)


def finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def epochs_of(folder):
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["epoch"] for line in lines]


def launches(folder):
    """The commands that launch.log shows the trial was launched with."""
    log = (Path(folder) / "launch.log").read_text().splitlines()
    return [line for line in log if line.startswith("$ ")]


def test_a_sweep_prunes_a_loser_and_continues_a_trial_cut_off_by_ctrl_c(tiny_mnist, tmp_path):
    # lr is 1.0 (learns) or 1e-4 (does not): the sampler's seed 0 draws 1.0, then 1e-4. No
    # pruning before epoch 2 (--prune_warmup), so the loser, cut off by Ctrl-C in its epoch 2,
    # is pruned by the sweep that continues it: 3 launches in all.
    out = tmp_path / "sweep"
    command = sweep_command(
        tiny_mnist,
        out,
        "--seed",
        0,
        "--prune_after",
        1,
        "--prune_warmup",
        2,
        "--param",
        "lr=choice:0.0001,1.0",
        "--param",
        "gamma=uniform:0.5:0.9",
        trials=2,
    )
    # Ctrl-C once trial 1 (lr 1e-4) has finished its first epoch: it stops at a checkpoint.
    proc = start_sweep(command, threads=1)
    trial_0, trial_1 = out / "trial-0000", out / "trial-0001"
    wait_for(lambda: (trial_1 / "metrics.jsonl").exists(), proc, timeout=240)
    os.killpg(proc.pid, signal.SIGINT)
    code, output = finish(proc)
    assert code == 130, output
    assert "trial 1: stopped at a checkpoint" in output, output
    assert (trial_1 / "checkpoints").is_dir() and not (trial_1 / "model.safetensors").exists()
    assert epochs_of(trial_1) != list(range(1, EPOCHS + 1)), "trial 1 ended before Ctrl-C"
    assert epochs_of(trial_0) == list(range(1, EPOCHS + 1))

    # The same command continues: trial 1 from its checkpoint, which the pruner then stops at
    # another checkpoint, after its epoch 2.
    code, output = finish(start_sweep(command, threads=1))
    assert code == 0, output
    log = (trial_1 / "launch.log").read_text()
    assert len(launches(trial_1)) == 2 and launches(trial_1)[1].endswith("--resume latest"), log
    assert "resumed from" in log and "step 0)" not in log  # not from scratch
    assert log.count("stopped at step") == 2, log  # by Ctrl-C, then by the pruner
    assert "trial 1: pruned after epoch 2" in output, output
    assert len(epochs_of(trial_1)) < EPOCHS
    table = output[output.index("trial  state") :].splitlines()
    assert [row.split()[:2] for row in table[1:3]] == [["0", "complete"], ["1", "pruned"]], output
    assert len(launches(trial_0)) == 1
    assert table[3] == f"best: trial 0, accuracy {table[1].split()[2]}:", output
    assert table[4].strip() == without_port(launches(trial_0)[0]), output
    assert (out / "study.db").is_file()  # SQLite by default


def without_port(launch_line):
    """The command of a launch.log line, less the port the sweep picked for that launch."""
    words = shlex.split(launch_line[2:])
    i = words.index("--main_process_port")
    return shlex.join(words[:i] + words[i + 2 :])


def kill_outside_the_journals_lock(proc, journal):
    """kill -9 of `proc` at a moment it does not hold Optuna's lock on `journal`: a lock left by
    a killed process holds the next sweeps up for Optuna's grace period (30 s), in which the
    orphaned trial could finish before anyone takes it over. Stopped first, so that it cannot
    take the lock between the look and the kill."""
    held = journal.with_name(journal.name + ".lock")
    while True:
        proc.send_signal(signal.SIGSTOP)
        if not os.path.lexists(held):
            break
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    proc.kill()
    proc.communicate()


@pytest.mark.slow
def test_a_killed_sweeps_trial_is_taken_over_and_two_sweeps_share_one_study(tiny_mnist, tmp_path):
    out, journal = tmp_path / "sweep", tmp_path / "shared" / "study.journal"
    journal.parent.mkdir()
    epochs = 12  # trial 0 still trains when the next sweep starts, with room to spare
    command = sweep_command(
        tiny_mnist,
        out,
        "--storage",
        journal,
        "--pruner",
        "none",
        "--param",
        "lr=loguniform:0.1:2",
        trials=2,
        epochs=epochs,
    )
    # kill -9 of the sweep alone, as a lost login session leaves it: its trial goes on training.
    killed = start_sweep(command, threads=1)
    trial_0 = out / "trial-0000"
    wait_for(lambda: (trial_0 / "metrics.jsonl").exists(), killed)
    kill_outside_the_journals_lock(killed, journal)
    # Two sweep processes on the study: one takes trial 0 over (stops its run at a checkpoint and
    # continues it), the other runs trial 1; neither runs a trial the other runs.
    first, second = start_sweep(command, threads=1), start_sweep(command, threads=1)
    results = [finish(first), finish(second)]
    assert [code for code, _ in results] == [0, 0], results
    outputs = "".join(output for _, output in results)
    assert "trial-0000: the run of a sweep that was killed is still going" in outputs, outputs
    assert launches(trial_0)[1].endswith("--resume latest"), launches(trial_0)
    folders = sorted(out.glob("trial-*"))
    assert [f.name for f in folders] == ["trial-0000", "trial-0001"]
    for folder in folders:
        assert len(launches(folder)) == (2 if folder == trial_0 else 1), folder
        assert epochs_of(folder) == list(range(1, epochs + 1)), folder
    finished = re.findall(r"^trial (\d+): accuracy", outputs, re.M)
    assert sorted(finished) == ["0", "1"], outputs  # each trial finished once, by one process
    assert journal.is_file()


def run_here(argv, capsys):
    """scripts/sweep.py's main() in this process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as stopped:
        sweep.main([str(a) for a in argv])
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--study", "s", "--param", "lr=log:1:2", "--", "recipes/mnist.py"],
            "--param 'lr=log:1:2': write NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH "
            "or choice:A,B,C",
        ),
        (
            ["--study", "s", "--param", "lr=loguniform:0:1", "--", "recipes/mnist.py"],
            "LOW must be below HIGH (and above 0 for loguniform)",
        ),
        (
            ["--study", "s", "--param", "lr=uniform:0.1:1"],
            "give the recipe after --, as after accelerate launch: -- recipes/mnist.py",
        ),
        (
            ["--study", "s", "--param", "lr=uniform:0.1:1", "--", "recipes/mnist.py", "--lr", 1],
            "--lr is given after -- and set by the sweep: leave it out of the recipe's settings",
        ),
    ],
)
def test_a_bad_sweep_command_is_one_line(argv, message, capsys):
    code, err = run_here(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_a_storage_that_cannot_open_is_one_line(tmp_path, capsys):
    for storage in (tmp_path / "no" / "study.journal", tmp_path / "no" / "study.db"):
        argv = ["--study", "s", "--out", tmp_path / "sweep", "--storage", storage]
        code, err = run_here(
            [*argv, "--param", "lr=uniform:0.1:1", "--", "recipes/mnist.py"], capsys
        )
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: cannot open the study's storage {storage} ("), err


def test_a_sweep_without_optuna_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # what `import optuna` meets when missing
    argv = ["--study", "s", "--param", "lr=uniform:0.1:1", "--", "recipes/mnist.py"]
    code, err = run_here(argv, capsys)
    assert (code, err) == (
        2,
        "error: sweeps need the optuna package: pip install -r requirements-extras.txt\n",
    )
