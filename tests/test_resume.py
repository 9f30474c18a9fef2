"""Checkpoints and resume: exact continuation, atomic writes, restarts and interrupts."""

import os
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import (
    BIN,
    N_TEST,
    REPO,
    TWO_PROCESS_RUN,
    assert_ema_is_evaluated_and_followed,
    assert_ok,
    free_port,
    launch,
    read_metrics,
    run_here,
    start,
    stopped_at,
    wait_for,
)
from recipe_module import load_recipe
from safetensors.torch import load_file

from common.checkpoint import _WROTE, choose_checkpoint
from common.config import UserError

RECIPE = "recipes/mnist.py"
# 256 train samples, batch 32: 8 optimizer steps per epoch on 1 process, 4 on 2.
COMMON = ["--epochs", 2, "--batch_size", 32, "--eval_batch_size", 256]


def weights(out):
    return load_file(Path(out) / "model.safetensors")


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k] - b[k]).abs().max()}"


def train(data, out, *args, nproc=1):
    res = launch([RECIPE, "--dataset", data, "--output_dir", out, *COMMON, *args], nproc=nproc)
    assert_ok(res)
    return res


def test_stop_and_resume_gives_bit_identical_weights(tiny_mnist, mnist_checkpoint, tmp_path):
    # mnist_checkpoint ran 13 steps straight (8 an epoch), with a checkpoint at step 10.
    straight = mnist_checkpoint
    split = stopped_at(straight, 10, tmp_path / "split")  # mid-epoch 2
    # With the straight run's metrics.jsonl, as a run that went on past step 10 (to 13) and is
    # resumed from its step-10 checkpoint: the lines after it go, to be written again, once.
    shutil.copy(straight / "metrics.jsonl", split / "metrics.jsonl")
    res = train(tiny_mnist, split, "--max_steps", 13, "--resume", "latest")
    assert "resumed from" in res.output and "(epoch 2, step 10)" in res.output
    assert_identical(weights(straight), weights(split))
    # The resumed epoch's train_loss covers all its batches, those before the stop too.
    (whole,) = [r for r in read_metrics(straight) if r["step"] == 13 and r["epoch"] == 2]
    first, resumed = read_metrics(split)
    assert resumed["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-12, abs=0)
    assert (first["epoch"], resumed["epoch"], resumed["step"]) == (1, 2, 13)
    assert first == read_metrics(straight)[0]  # epoch 1's line kept as it was


@pytest.mark.slow
def test_max_steps_on_an_epoch_end_completes_it_resumes_exactly_and_a_finished_run_only_evaluates(
    tiny_mnist, mnist_checkpoint, tmp_path
):
    straight, split = mnist_checkpoint, tmp_path / "split"
    train(tiny_mnist, split, "--max_steps", 8)  # 8 steps an epoch: the end of epoch 1
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step-00000008"]
    res = train(tiny_mnist, split, "--max_steps", 13, "--resume", "latest")
    assert "(epoch 2, step 8)" in res.output
    assert [(r["epoch"], r["step"]) for r in read_metrics(split)] == [(1, 8), (2, 13)]
    assert_identical(weights(straight), weights(split))
    # The same command again: max_steps is reached already, so it only evaluates.
    before = sorted(p.name for p in (split / "checkpoints").iterdir())
    res = train(tiny_mnist, split, "--max_steps", 13, "--resume", "latest")
    assert (
        "epoch 2:" not in res.output
        and sorted(p.name for p in (split / "checkpoints").iterdir()) == before
    )
    assert read_metrics(split)[-1]["epoch"] is None and read_metrics(split)[-1]["step"] == 13
    assert_identical(weights(straight), weights(split))


@pytest.mark.slow
def test_resume_with_gradient_accumulation_is_exact(tiny_mnist, tmp_path):
    # 8 batches an epoch in groups of 3: steps of 3, 3 and 2 batches. Stop after step 4 (epoch 2,
    # batch 3); the resumed epoch must still weigh its short last group as the straight run does.
    straight, split = tmp_path / "straight", tmp_path / "split"
    accumulate = ["--gradient_accumulation_steps", 3]
    train(
        tiny_mnist,
        straight,
        *accumulate,
        "--max_steps",
        6,
        "--checkpoint_every_steps",
        4,
        "--keep_checkpoints",
        5,
    )
    res = train(
        tiny_mnist,
        stopped_at(straight, 4, split),
        *accumulate,
        "--max_steps",
        6,
        "--resume",
        "latest",
    )
    assert "(epoch 2, step 4)" in res.output
    assert_identical(weights(straight), weights(split))


def test_two_process_resume_is_exact_too_with_the_moving_average(
    tiny_mnist, mnist_two_processes, tmp_path
):
    # The shared 2-process run has the moving average of the weights (ema_decay) on: one run
    # proves both resume exactly. 1-process resume without it: above.
    straight, _ = mnist_two_processes  # 7 steps, 4 an epoch on 2 processes
    split = stopped_at(straight, 3, tmp_path / "split")  # mid-epoch 1: each rank skips 3 batches
    assert (split / "checkpoints" / "step-00000003" / "random_states_1.pkl").is_file()
    res = launch(
        [RECIPE, "--dataset", tiny_mnist, "--output_dir", split, *TWO_PROCESS_RUN]
        + ["--resume", "latest"],
        nproc=2,
        launcher="torchrun",
    )
    assert_ok(res)
    assert "(epoch 1, step 3)" in res.output
    assert_identical(weights(straight), weights(split))
    assert_identical(*(load_file(out / "model_ema.safetensors") for out in (straight, split)))
    assert_ema_is_evaluated_and_followed(straight, steps=7, steps_per_epoch=4)


@pytest.mark.slow
def test_a_compiled_ddp_model_resumes_exactly_evaluates_every_sample_and_saves_plain_weights(
    tiny_mnist, tmp_path
):
    # torch.compile as users turn it on: the dynamo_config of the shipped
    # accelerate_configs/1gpu_cudagraphs.yaml, on 2 processes, so Accelerate compiles the
    # DDP-wrapped model. The CPU compiles without CUDA graphs (mode reduce-overhead then builds
    # what the default mode builds), but the config must load and the step stay exact. The
    # default mode's lines (compile_config) are launched by test_unet_training.py's compile probe.
    shipped = yaml.safe_load((REPO / "accelerate_configs" / "1gpu_cudagraphs.yaml").read_text())
    config = tmp_path / "cudagraphs-2proc.yaml"
    two = yaml.safe_load((REPO / "accelerate_configs" / "2gpu.yaml").read_text())
    config.write_text(yaml.safe_dump({**two, "dynamo_config": shipped["dynamo_config"]}))
    args = ["--epochs", 2, "--batch_size", 48, "--eval_batch_size", 256]

    def run(out, *more):
        res = launch(
            [RECIPE, "--dataset", tiny_mnist, "--output_dir", out, *args, *more],
            nproc=2,
            config=config,
        )
        assert_ok(res)
        assert "torch.compile backend inductor mode reduce-overhead" in res.output
        return res

    straight, split = tmp_path / "straight", tmp_path / "split"
    run(straight, "--checkpoint_every_steps", 2, "--keep_checkpoints", 5)
    stopped_at(straight, 2, split)  # mid-epoch 1: 3 steps of 48 an epoch per rank (even_batches)
    assert "(epoch 1, step 2)" in run(split, "--resume", "latest").output
    assert_identical(
        weights(straight), weights(split)
    )  # dropout included: its RNG state resumes too
    # 201 test samples over 2 ranks x 256: the padding of the last batch is never counted,
    # after epochs 1 and 2 of either run.
    assert [r["eval_samples"] for r in read_metrics(straight)] == [N_TEST] * 2
    assert [r["eval_samples"] for r in read_metrics(split)] == [N_TEST] * 2
    # model.safetensors has the plain model's keys, not torch.compile's `_orig_mod.` ones.
    assert "conv1.weight" in weights(straight) and not any(
        k.startswith("_orig_mod.") for k in weights(straight)
    )


@pytest.mark.slow
def test_keep_last_checkpoints_and_ignore_unfinished_writes(tiny_mnist, tmp_path):
    train(
        tiny_mnist,
        tmp_path,
        "--max_steps",
        6,
        "--checkpoint_every_steps",
        2,
        "--keep_checkpoints",
        2,
    )
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000006"]
    # Going on from the older one here would let step-6 outrank (and keep_checkpoints delete) the
    # new ones.
    with pytest.raises(UserError, match="is older than step-00000006 in the same folder"):
        choose_checkpoint(str(ckpts / "step-00000004"), ckpts)
    # What a run killed while writing step 8 leaves behind: a temporary folder, half written.
    partial = ckpts / ".tmp-step-00000008"
    shutil.copytree(ckpts / "step-00000006", partial)
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    res = train(tiny_mnist, tmp_path, "--max_steps", 8, "--resume", "latest")
    assert "(epoch 1, step 6)" in res.output
    assert not partial.exists()


def test_a_checkpoint_that_cannot_load_is_one_line_and_deletes_nothing(
    tiny_mnist, mnist_checkpoint, tmp_path, capsys
):
    run = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-00000013"
    model_file = ckpt / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated
    # In this process, as `python recipes/mnist.py` runs it: a launch adds only its start
    # (launched in the full tier: test_loading_a_checkpoint_never_runs_code, whose checkpoint
    # cannot load either, and test_errors.py's resume stopped by bad input).
    args = ["--dataset", tiny_mnist, "--output_dir", run, *COMMON, "--resume", "latest"]
    code = run_here(load_recipe("mnist"), args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: cannot load checkpoint {ckpt}"), err
    assert model_file.stat().st_size == 1000 and (ckpt / "optimizer.bin").is_file()


def test_bad_resume_choices_say_what_to_do(mnist_checkpoint, tmp_path):
    # The launches of these: test_errors.py ("resume path"), test_faults.py (a mistyped folder).
    root = mnist_checkpoint / "checkpoints"
    (tmp_path / "empty").mkdir()
    for args, message in [
        (dict(resume=str(tmp_path / "nope")), "resume checkpoint"),
        (dict(resume=None), "holds checkpoints of an earlier run: add --resume latest"),
        (
            dict(resume="latest", eval_only=True, root=tmp_path / "empty" / "checkpoints"),
            f"eval_only found no checkpoint in {tmp_path / 'empty' / 'checkpoints'}",
        ),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            choose_checkpoint(args.pop("resume"), args.pop("root", root), **args)


@pytest.mark.slow
def test_a_restart_never_takes_over_an_earlier_runs_checkpoints(
    tiny_mnist, mnist_checkpoint, tmp_path
):
    # The first attempt stops on "holds checkpoints of an earlier run"; torchrun restarts it, and
    # the restarted workers must stop the same way, not resume the run they were refused.
    tmp_path = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    before = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    res = launch(
        [RECIPE, "--dataset", tiny_mnist, "--output_dir", tmp_path, *COMMON],
        nproc=2,
        launcher="torchrun",
        launcher_args=["--max-restarts", 1],
    )
    assert res.returncode != 0 and "resumed from" not in res.output
    assert res.output.count("holds checkpoints of an earlier run") >= 2  # once per attempt
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == before


def test_a_restart_goes_on_from_this_jobs_last_checkpoint_and_never_from_another_runs(
    tmp_path, monkeypatch
):
    # What torchrun's restarted workers find: the agent's store, which outlives them, and
    # checkpoints from this job and maybe from others. Here this job resumed step-4 (copied in
    # from elsewhere) and wrote step-8; step-12 is left from an abandoned run.
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for step in (4, 8, 12):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / "trainer_state.json").write_text("{}")
    named = tmp_path / "step-00000004"
    # Before this job wrote a checkpoint, a restart starts as its first attempt did: no takeover
    # of the newer checkpoints, and no going on from an older one among them.
    with pytest.raises(UserError, match="holds checkpoints of an earlier run"):
        choose_checkpoint(None, tmp_path, restarted=True)
    with pytest.raises(
        UserError, match="step-00000004 is older than step-00000012 in the same folder: to go on"
    ):
        choose_checkpoint(str(named), tmp_path, restarted=True)
    assert (
        choose_checkpoint(str(named), tmp_path, eval_only=True) == named
    )  # evaluating it writes nothing
    store.set(_WROTE, "step-00000008")  # what save_checkpoint records
    assert choose_checkpoint(str(named), tmp_path, restarted=True) == tmp_path / "step-00000008"
    assert choose_checkpoint(None, tmp_path, restarted=True) == tmp_path / "step-00000008"


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_loading_a_checkpoint_never_runs_code(tiny_mnist, mnist_checkpoint, tmp_path):
    tmp_path = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker
    torch.save({"state": exploit}, tmp_path / "checkpoints" / "step-00000013" / "optimizer.bin")
    res = launch(
        [RECIPE, "--dataset", tiny_mnist, "--output_dir", tmp_path, *COMMON, "--resume", "latest"],
        launcher="python",
    )
    assert res.returncode == 2 and "cannot load checkpoint" in res.output, res
    assert not marker.exists()


@pytest.mark.slow
def test_old_ddp_checkpoint_with_module_prefix_loads(mnist_checkpoint, tmp_path):
    # What --weights does with a file of a DDP-era script (a `module.` prefix, torch.save) or of
    # a compiled model (`_orig_mod.`), checked in-process: the same tensors, bit for bit. The
    # launch with --weights is test_mnist.py's test_eval_is_identical_on_one_and_two_processes.
    from recipe_module import load_recipe

    from common.checkpoint import load_weights
    from common.config import parse_config

    mnist = load_recipe("mnist")
    state = weights(mnist_checkpoint)
    for prefix, name in (("module.", "ddp_era.pt"), ("_orig_mod.", "compiled.pt")):
        torch.save({prefix + k: v for k, v in state.items()}, tmp_path / name)
        cfg = parse_config(mnist.Config, ["--eval_only", "--weights", str(tmp_path / name)])
        model = mnist.BasicNet(num_classes=10)
        load_weights(model, cfg.weights)
        assert_identical(model.state_dict(), state)


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_the_latest_checkpoint(tiny_mnist, tmp_path):
    epochs = 6  # killed after its second epoch: the rest, with room to spare, after the restart
    cmd = [
        BIN / "torchrun",
        "--nproc_per_node",
        2,
        "--max-restarts",
        1,
        "--master_port",
        free_port(),
        RECIPE,
        "--dataset",
        tiny_mnist,
        "--output_dir",
        tmp_path,
        "--epochs",
        epochs,
        "--batch_size",
        32,
        "--eval_batch_size",
        512,
    ]
    proc = start(cmd)
    try:
        wait_for(lambda: len(list((tmp_path / "checkpoints").glob("step-*"))) >= 2, proc)
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if p.environ().get("RANK") == "1" and "mnist" in " ".join(p.cmdline())
        ]
        assert len(workers) == 1
        workers[0].kill()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from" in out
    rows = read_metrics(tmp_path)
    assert (
        rows[-1]["epoch"] == epochs
        and rows[-1]["step"] == epochs * 4
        and rows[-1]["eval_samples"] == N_TEST
    )
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "best.safetensors").is_file()
