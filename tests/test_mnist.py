"""The MNIST recipe, launched as users launch it, on tiny real-digit data."""

import gc
import json
import shutil

import pytest
import torch
import yaml
from conftest import N_TEST, N_TRAIN, assert_ok, copy_with_tiny_model, launch, read_metrics
from recipe_module import load_recipe
from safetensors.torch import load_file

RECIPE = "recipes/mnist.py"
REQUIRED = {
    "epoch",
    "step",
    "world_size",
    "train_loss",
    "eval_samples",
    "accuracy",
    "train_samples_per_s",
    "peak_memory_mb",  # training's
    "eval_peak_memory_mb",  # evaluation's
}


def test_single_process_writes_the_output_contract(mnist_run):
    out, res = mnist_run  # python, stopped by max_steps at step 13, in epoch 2
    rows = [r for r in read_metrics(out) if r["epoch"] is not None]  # not tests' eval_only lines
    assert [r["epoch"] for r in rows] == [1, 2]
    assert REQUIRED <= rows[-1].keys()
    assert rows[-1]["world_size"] == 1
    assert rows[-1]["eval_samples"] == N_TEST
    assert [r["step"] for r in rows] == [N_TRAIN // 32, 13]
    assert 0.0 <= rows[-1]["accuracy"] <= 1.0
    assert yaml.safe_load((out / "config.yaml").read_text())["batch_size"] == 32
    weights = load_file(out / "model.safetensors")
    assert "fc2.weight" in weights and not any(k.startswith("module.") for k in weights)
    assert f"outputs in {out}/" in res.output


def test_two_processes_under_torchrun_count_every_test_sample_and_exit_cleanly_with_workers(
    mnist_two_processes,
):
    # 201 test samples over 2 processes x batch 64: the last batch is padded with duplicates,
    # and every one of them must be dropped from the count. With 2 persistent DataLoader workers
    # per process, both processes must still exit cleanly (assert_ok, in the fixture: no abort at
    # shutdown). torchrun, as accelerate launch, runs real DDP.
    out, res = mnist_two_processes
    assert "2 process(es) on cpu, gloo" in res.output
    # A step of 2 processes takes twice one process's samples: the start-up says so, and how not.
    assert (
        "batch 32 per process = 64 per optimizer step (2 times one process's: "
        "--global_batch_size 64 keeps this run's on any process count, --global_batch_size 32 "
        "trains as 1 process does)" in res.output
    )
    rows = read_metrics(out)
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 4), (2, 7)]
    assert all(r["world_size"] == 2 and r["eval_samples"] == N_TEST for r in rows), rows
    assert rows[0]["lr"] == 2.0  # scale_lr: lr 1.0 x 2 processes


@pytest.mark.slow
def test_run_keeps_what_the_imports_and_main_made_out_of_every_collection():
    # close() and run() collect the garbage to drop the DDP model before the process group goes.
    # With the ~400,000 objects of torch's imports in sight, that took over 0.5 s of every exit.
    # What main made is out of sight of the interpreter's last collections: 0.4 s more.
    from recipe_module import load_recipe

    from common.runtime import run

    seen, made = {}, []

    def main(cfg):
        seen["frozen"] = gc.get_freeze_count()
        made.extend([None] for _ in range(10_000))  # lists: objects the collector tracks

    try:
        with pytest.raises(SystemExit) as e:
            run(main, load_recipe("mnist").Config, [])
        seen["at_exit"] = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert e.value.code == 0 and seen["frozen"] > 100_000, seen
    # Frozen objects that are freed leave the count: a few of those before main were.
    assert seen["at_exit"] - seen["frozen"] > len(made) - 100, seen


def test_eval_is_identical_on_one_and_two_processes(mnist_two_processes, tiny_mnist):
    # The 2-process run's last evaluation, of the weights it saved, and the recipe's evaluate()
    # on 1 process of those weights, in the test process as an --eval_only run calls it (a
    # launch would add nothing that the 2-process run does not show): the same accuracy.
    from common.config import parse_config

    two, _ = mnist_two_processes
    mnist = load_recipe("mnist")
    args = ["--dataset", tiny_mnist, "--eval_only", "--weights", two / "model.safetensors"]
    cfg = parse_config(mnist.Config, [str(a) for a in [*args, "--eval_batch_size", 64]])
    accelerator = mnist.accelerator_for(cfg)
    cfg, _, test_loader = mnist.settle(cfg, accelerator)
    model = mnist.build_model(test_loader.dataset.classes)
    mnist.load_weights(model, cfg.weights)
    model, test_loader = accelerator.prepare(model, test_loader)
    one = mnist.evaluate(model, test_loader, accelerator)
    last = read_metrics(two)[-1]
    assert (accelerator.num_processes, last["world_size"]) == (1, 2)
    assert one["eval_samples"] == last["eval_samples"] == N_TEST
    assert one["accuracy"] == last["accuracy"]
    assert one["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_eval_only_into_the_training_folder_adds_a_line_and_keeps_its_config(
    mnist_checkpoint, tiny_mnist, tmp_path
):
    out = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    config, rows = (out / "config.yaml").read_text(), len(read_metrics(out))
    weights = out / "model.safetensors"
    assert_ok(
        launch(
            [
                RECIPE,
                "--dataset",
                tiny_mnist,
                "--output_dir",
                out,
                "--eval_only",
                "--weights",
                weights,
            ],
            launcher="python",
        )
    )
    assert (
        out / "config.yaml"
    ).read_text() == config  # --config out/config.yaml still repeats the training run
    assert len(read_metrics(out)) == rows + 1 and read_metrics(out)[-1]["weights"] == str(weights)


def test_shards_are_disjoint_and_reshuffled_from_the_seed(tiny_mnist, tmp_path):
    # One 2-process launch: the loaders built for seed 1, for seed 2, then for seed 1 again, as
    # the recipe builds them. That a run in another process gets the same order for the same
    # seed: every bit-exact resume (test_resume.py, test_unet_training.py).
    res = launch(
        ["tests/shard_probe.py", "--dataset", tiny_mnist, "--batch_size", 16, "--seed", 1, 2, 1],
        nproc=2,
        env={"PROBE_OUT": str(tmp_path)},
    )
    assert_ok(res)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    first, other, again = ([rank[i] for rank in ranks] for i in range(3))
    for epoch in ("1", "2"):
        rank0, rank1 = first[0][epoch], first[1][epoch]
        assert len(rank0) == len(rank1) == N_TRAIN // 2
        assert not set(rank0) & set(rank1)
        assert set(rank0) | set(rank1) == set(range(N_TRAIN))
    assert first[0]["1"] != first[0]["2"], "the order must change every epoch"
    assert first == again, "the same seed must give the same order"
    assert first[0]["1"] != other[0]["1"], "another seed must give another order"


@pytest.mark.slow
def test_accumulation_counts_optimizer_steps_and_a_short_last_group_steps_with_the_mean_gradient(
    tiny_mnist, tmp_path
):
    # 256 samples in batches of 32, accumulated 3 at a time, are groups of 3, 3 and 2 batches:
    # the samples of batches of 96, 96 and 64 without accumulation. With a model that has no
    # dropout or batch norm, the two runs must train the same weights, also on the short step.
    assert N_TRAIN == 256
    with copy_with_tiny_model() as copy:
        for out, batch_size, group in (("accumulated", 32, 3), ("whole", 96, 1)):
            res = launch(
                [
                    copy,
                    "--dataset",
                    tiny_mnist,
                    "--output_dir",
                    tmp_path / out,
                    "--epochs",
                    1,
                    "--batch_size",
                    batch_size,
                    "--gradient_accumulation_steps",
                    group,
                ],
                launcher="python",
            )
            assert_ok(res)
            assert f"batch {batch_size} per process = 96 per optimizer step" in res.output
    accumulated, whole = (
        load_file(tmp_path / out / "model.safetensors") for out in ("accumulated", "whole")
    )
    assert (
        read_metrics(tmp_path / "accumulated")[0]["step"]
        == read_metrics(tmp_path / "whole")[0]["step"]
        == 3
    )
    for k in whole:
        assert torch.allclose(accumulated[k], whole[k], rtol=0, atol=1e-6), (
            (accumulated[k] - whole[k]).abs().max()
        )
