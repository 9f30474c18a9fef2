"""--global_batch_size: the same optimizer steps on any number of processes, and a mid-epoch
resume on another process count."""

import json
import re

import pytest
import torch
from conftest import (
    N_TEST,
    N_TRAIN,
    RECORDING_MODEL,
    VAL_FRACTION,
    FakeAccelerator,
    assert_ok,
    copy_with_tiny_model,
    launch,
    read_metrics,
    saved_run,
    stopped_at,
)
from recipe_module import load_recipe
from safetensors.torch import load_file

from common.checkpoint import resume_training
from common.config import ConfigError, UserError, parse_config
from common.progress import Progress

GLOBAL = 48  # of the 256 training samples: 5 global batches an epoch, 16 samples left out


def steps(ids, processes, accumulation):
    """The sample ids of every optimizer step, from the files of the recording model (conftest's
    RECORDING_MODEL): each rank's batches in groups of `accumulation`, read micro-step by
    micro-step, rank by rank."""
    ranks = [
        [json.loads(line) for line in (ids / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(processes)
    ]
    assert len({len(batches) for batches in ranks}) == 1, "every rank trains as many batches"
    return [
        [i for j in range(accumulation) for batches in ranks for i in batches[s * accumulation + j]]
        for s in range(len(ranks[0]) // accumulation)
    ]


def largest_difference(a, b, weights="model.safetensors"):
    a, b = (load_file(out / weights) for out in (a, b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_metrics(run, reference):
    """The rows of metrics.jsonl alike but for the order of float sums."""
    for row, expected in zip(read_metrics(run), read_metrics(reference), strict=True):
        assert row["eval_samples"] == expected["eval_samples"] == N_TEST
        assert row["accuracy"] == expected["accuracy"]
        for key in ("eval_loss", "train_loss"):
            assert row[key] == pytest.approx(expected[key], rel=1e-5), key


@pytest.fixture(scope="module")
def recording_copy():
    """A copy of the MNIST recipe whose model (a linear layer: no dropout, no BatchNorm) writes
    down the ids of the samples it trains on; one copy for the module, as a checkpoint resumes
    only in the recipe of its name."""
    with copy_with_tiny_model(RECORDING_MODEL) as copy:
        yield copy


def train(copy, data, out, nproc, batch_size, *more):
    """2 epochs of 5 global batches of 48 with the recording copy into `out`, its sample ids
    into out-ids/: (out, the ids' folder, the output)."""
    ids = out.with_name(f"{out.name}-ids")
    ids.mkdir()
    res = launch(
        [
            copy,
            "--dataset",
            data,
            "--output_dir",
            out,
            "--epochs",
            2,
            "--global_batch_size",
            GLOBAL,
            "--batch_size",
            batch_size,
            "--eval_batch_size",
            256,
            "--checkpoint_every_steps",
            3,
            "--keep_checkpoints",
            5,
            *more,
        ],
        nproc=nproc,
        env={"PROBE_OUT": str(ids)},
    )
    assert_ok(res)
    return out, ids, res.output


@pytest.fixture(scope="module")
def two_processes(recording_copy, tiny_mnist, tmp_path_factory):
    """The run the others are compared with: 2 processes, a batch of 24 each, no accumulation;
    checkpoints at steps 3, 5 (epoch 1's end), 6, 9 and 10. Its optimizer steps' sample ids."""
    out, ids, output = train(
        recording_copy, tiny_mnist, tmp_path_factory.mktemp("g") / "two", 2, 24
    )
    assert "global batch 48 = 24 per process x 2 process(es) x 1 accumulation step(s)" in output
    straight = steps(ids, 2, 1)
    assert len(straight) == 2 * (N_TRAIN // GLOBAL) == read_metrics(out)[-1]["step"]
    assert all(len(set(step)) == GLOBAL for step in straight)
    for epoch in (straight[:5], straight[5:]):  # each sample at most once an epoch
        assert len({i for step in epoch for i in step}) == N_TRAIN // GLOBAL * GLOBAL
    assert straight[:5] != straight[5:], "a new order every epoch"
    return out, straight


def test_a_global_batch_resumes_mid_epoch_on_another_process_count_with_the_same_steps(
    recording_copy, tiny_mnist, two_processes, tmp_path
):
    # Stopped after step 3 on 2 processes, resumed on 1 as 2 accumulated batches of 24.
    two, straight = two_processes
    resumed = stopped_at(two, 3, tmp_path / "resumed")  # mid-epoch 1
    _, ids, output = train(recording_copy, tiny_mnist, resumed, 1, 24, "--resume", "latest")
    assert "global batch 48 = 24 per process x 1 process(es) x 2 accumulation step(s)" in output
    assert "(epoch 1, step 3)" in output
    # The same samples in every optimizer step after the resume, in the same order.
    assert steps(ids, 1, 2) == straight[3:]
    # No dropout, no BatchNorm: the same weights and metrics, but for the order of float sums.
    assert largest_difference(resumed, two) < 1e-6
    assert_same_metrics(resumed, two)


@pytest.mark.slow
def test_one_process_trains_the_steps_of_two_and_hands_them_back_mid_epoch(
    recording_copy, tiny_mnist, two_processes, tmp_path
):
    # On 1 process as 3 accumulated batches of 16; stopped after step 3 and resumed on 2
    # processes, as 2 accumulated batches of 12 each.
    two, straight = two_processes
    one, ids, output = train(recording_copy, tiny_mnist, tmp_path / "one", 1, 16)
    assert "global batch 48 = 16 per process x 1 process(es) x 3 accumulation step(s)" in output
    assert steps(ids, 1, 3) == straight
    epoch_end = "checkpoints/step-00000005/model.safetensors"
    assert largest_difference(one, two, epoch_end) < 1e-6  # after an epoch
    assert largest_difference(one, two) < 1e-6
    assert_same_metrics(one, two)
    resumed = stopped_at(one, 3, tmp_path / "resumed")
    _, ids, output = train(recording_copy, tiny_mnist, resumed, 2, 12, "--resume", "latest")
    assert "(epoch 1, step 3)" in output
    assert steps(ids, 2, 2) == straight[3:]
    assert largest_difference(resumed, two) < 1e-6
    assert_same_metrics(resumed, two)


@pytest.mark.slow
def test_bucketed_unet_steps_hold_the_same_images_on_1_and_2_processes(mixed_shapes, tmp_path):
    # 32 training images of mixed sizes, in global batches of 8 images of similar sizes: on 1
    # process as 4 accumulated batches of 2, on 2 processes as one batch of 4 each.
    def probe(nproc, batch_size):
        out = tmp_path / str(nproc)
        out.mkdir()
        res = launch(
            [
                "tests/step_probe.py",
                "--dataset",
                mixed_shapes,
                "--bucket_by_size",
                "--global_batch_size",
                8,
                "--batch_size",
                batch_size,
                "--val_fraction",
                VAL_FRACTION,
                "--num_workers",
                0,
            ],
            nproc=nproc,
            env={"PROBE_OUT": str(out)},
        )
        assert_ok(res)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]

    (one,), two = probe(1, 2), probe(2, 4)
    for epoch in ("1", "2"):
        assert [[len(b) for b in step] for step in one[epoch]] == [[2] * 4] * 4
        assert all([len(b) for b in step] == [4] for rank in two for step in rank[epoch])
        steps = [[i for batch in step for i in batch] for step in one[epoch]]
        assert steps == [
            [i for rank in two for i in rank[epoch][s][0]] for s in range(len(two[0][epoch]))
        ]
        assert all(len(set(step)) == 8 for step in steps)
    assert one["1"] != one["2"], "a new order every epoch"


def test_the_global_batch_is_split_by_the_process_count_and_batch_size():
    mnist, unet = load_recipe("mnist"), load_recipe("unet")
    for processes, cap, split in [
        (1, 64, (48, 1)),
        (1, 16, (16, 3)),
        (2, 24, (24, 1)),
        (2, 16, (12, 2)),  # the largest batch up to 16 that divides 24
        (3, 100, (16, 1)),
        (16, 64, (3, 1)),
    ]:
        cfg = mnist.Config(global_batch_size=48, batch_size=cap).split_global_batch(processes)
        assert (cfg.batch_size, cfg.gradient_accumulation_steps) == split
    plain = mnist.Config(batch_size=32, gradient_accumulation_steps=2)
    assert plain.split_global_batch(2) == plain
    # overfit_batches N: the samples of the first N optimizer steps, on any process count.
    for processes in (1, 2, 3):
        cfg = mnist.Config(global_batch_size=48, batch_size=16, overfit_batches=2)
        assert cfg.split_global_batch(processes).overfit_samples(processes) == 96
    with pytest.raises(ConfigError, match="global_batch_size 48 does not split evenly over 5 pro"):
        mnist.Config(global_batch_size=48).split_global_batch(5)
    for recipe, args, message in [
        (mnist, ["--scale_lr"], "the learning rate needs no scaling: leave scale_lr off"),
        (unet, ["--max_batch_pixels", "4096"], "global_batch_size counts images, max_batch_pix"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(recipe.Config, ["--global_batch_size", "48", *args])


def resume(path, cfg, processes):
    """resume_training() of a saved_run() checkpoint as the main process of `processes`."""
    mnist, accelerator = load_recipe("mnist"), FakeAccelerator(processes)
    progress = Progress(accelerator, cfg, metric="accuracy")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    resume_training(
        accelerator,
        path,
        cfg,
        progress=progress,
        scheduler=torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=16),
        recipe="mnist",
        data_order=mnist.DATA_ORDER,
        mask_values=[0, 255],
    )
    return progress, accelerator


def test_a_mid_epoch_checkpoint_goes_on_with_another_process_count_only_with_a_global_batch(
    tmp_path,
):
    # Both checkpoints are written after 3 batches of 24 on each of 2 processes.
    _, cfg, _, path = saved_run(tmp_path / "plain", processes=2, batch_size=24)
    message = (
        "was written mid-epoch by 2 processes: resume it with 2 processes, or from a checkpoint "
        "written at the end of an epoch (runs with --global_batch_size resume mid-epoch on any "
        "process count)"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        resume(path, cfg, processes=1)
    evaluated, _ = resume(path, cfg.__class__(**{**vars(cfg), "eval_only": True}), processes=1)
    assert evaluated.step == 3, "eval_only reads any checkpoint"

    _, cfg, _, path = saved_run(
        tmp_path / "global", processes=2, batch_size=24, global_batch_size=48
    )
    on_one = cfg.__class__(**{**vars(cfg), "batch_size": 16}).split_global_batch(1)
    progress, accelerator = resume(path, on_one, processes=1)  # 3 global batches of 48 done
    assert (progress.step, progress.batches_done, accelerator.step) == (3, 9, 9)
    with pytest.raises(UserError, match="written mid-epoch with global_batch_size 48, not 96: r"):
        resume(path, cfg.__class__(**{**vars(cfg), "global_batch_size": 96}), processes=2)
