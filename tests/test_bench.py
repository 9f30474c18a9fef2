"""scripts/bench.py: the fast preset benchmarked with the recipe's own optimizer and schedule,
the U-Net's settings resolved as its main() resolves them, and the FLOP count, against counts
done by hand and the figure of issue 18."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import N_IMAGES, N_VAL, ONE_THREAD, REPO, assert_ok, launch
from recipe_module import load_recipe

sys.path.append(str(REPO / "scripts"))  # bench_tools, after everything else: it shadows nothing
from bench_tools.flops import flops_per_sample  # noqa: E402
from bench_tools.unet import bench_unet  # noqa: E402


@pytest.mark.slow
def test_bench_runs_the_fast_preset_with_its_optimizer_and_schedule(tiny_mnist, tmp_path):
    # 256 digits at the preset's batch 128: 2 steps an epoch, 1 + 2 repetitions of each variant.
    # The preset's OneCycleLR is planned over its 2 epochs (4 steps) and raises when stepped more
    # often: the recipe's 6 steps pass only because the bench plans it over its repetitions.
    out = tmp_path / "fast.json"
    res = launch(
        [
            "scripts/bench.py",
            "--config",
            "recipes/configs/mnist_fast.yaml",
            "--dataset",
            tiny_mnist,
            "--warmup",
            1,
            "--reps",
            2,
            "--startup_runs",
            1,
            "--threads",
            1,
            "--json",
            out,
        ],
        launcher="python",
    )
    assert_ok(res)
    report = json.loads(out.read_text())
    assert report["optimizer"].startswith("adamw(lr=0.004, weight_decay=0.01), scheduler onecycle")
    assert report["startup_cmd"][-5:-3] == ["--config", "recipes/configs/mnist_fast.yaml"]
    assert report["steps_per_rep"] == 2 and report["samples_per_rep"] == 256
    assert set(report["variants"]) == {"recipe", "bound", "classic_w0", "classic_w1"}
    for variant in report["variants"].values():
        assert variant["samples"] == [256, 256] and min(variant["samples_per_s"]) > 0
    assert report["recipe_over_bound_paired"] > 0 and len(report["startup"]) == 1
    table = out.with_suffix(".md").read_text().splitlines()
    assert table[0].startswith("| variant | median/s |") and table[2].startswith("| recipe | ")


@pytest.mark.slow
def test_the_unet_loader_bench_counts_every_training_image(shapes, tmp_path):
    # Its batches are (images, masks, the augmentation's random numbers): a loop that unpacked
    # two of them failed at the first batch.
    out = tmp_path / "loader.json"
    args = ["--val_fraction", "0.2", "--scale", "0.75", "--cache_images", "false"]
    res = launch(
        [
            "scripts/bench.py",
            "--recipe",
            "unet",
            "--dataset",
            shapes,
            "--loader",
            " ".join(args),
            "--warmup",
            0,
            "--reps",
            1,
            "--threads",
            1,
            "--json",
            out,
        ],
        launcher="python",
    )
    assert_ok(res)
    (variant,) = json.loads(out.read_text())["variants"].values()
    assert variant["samples"] == [N_IMAGES - N_VAL] and "images of 36x36;" in variant["data"]


@pytest.mark.slow
def test_flops_per_sample_counts_forward_and_backward_of_one_sample():
    # Linear 4 -> 3: forward 2 x 4 x 3 per sample; backward the weight gradient only (the input
    # needs none), 2 x 4 x 3 again.
    flops = flops_per_sample(
        lambda: torch.nn.Linear(4, 3),
        torch.zeros(4),
        torch.zeros(3),
        lambda out, y: ((out - y) ** 2).mean(),
    )
    assert flops == 48
    # The default U-Net (64 base channels, 4 classes) on 256x256: 288.9 GFLOP, as counted on the
    # H100 for issue 18.
    unet = load_recipe("unet")
    cfg = unet.Config(num_classes=4, in_channels=3)
    flops = flops_per_sample(
        lambda: unet.build_model({name: getattr(cfg, name) for name in unet.MODEL_SETTINGS}),
        torch.zeros(3, 256, 256, dtype=torch.uint8),
        torch.zeros(256, 256, dtype=torch.long),
        lambda logits, y: unet.loss_per_image(logits, y, num_classes=cfg.num_classes).mean(),
    )
    assert round(flops / 1e9, 1) == 288.9


@pytest.mark.slow
def test_the_unet_bench_measures_the_settings_that_main_trains_with(shapes, tmp_path):
    # main() writes config.yaml with every setting as it resolved it (channels_last auto, the
    # classes, the caching, the evaluation batch); the bench's variants must run on the same.
    # Once the bench tested channels_last for a string the Config no longer held, and so
    # measured the recipe with channels_last off where main() turned it on (an H100, 430
    # against 835 images/s).
    flags = {"base_channels": 8, "val_fraction": 0.2, "num_workers": 0, "batch_size": 4}
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(flags))
    out = tmp_path / "run"
    args = ["recipes/unet.py", "--dataset", shapes, "--config", preset, "--output_dir", out]
    res = launch([*args, "--smoke"], launcher="python", env=ONE_THREAD)
    assert_ok(res)
    trained = yaml.safe_load((out / "config.yaml").read_text())
    from common.accelerator import build_accelerator

    bench_args = SimpleNamespace(
        dataset=str(shapes),
        config=str(preset),
        workdir=str(tmp_path / "bench"),
        warmup=1,
        reps=2,
        steps=0,
        image_size=None,
        batch_size=None,
        also=[],
        quick=False,
    )
    info, _ = bench_unet(bench_args, build_accelerator())
    # What the bench sets itself: a run as long as its repetitions, no checkpoint, no smoke.
    own = {"output_dir", "epochs", "max_steps", "checkpoint_every_steps", "smoke"}
    measured = {k: v for k, v in info["settings"].items() if k not in own}
    assert measured == {k: v for k, v in trained.items() if k not in own}
    assert measured["channels_last"] is False and measured["eval_batch_size"] == 4


@pytest.mark.slow
def test_quick_gives_the_three_rows_and_the_full_benchs_time(tiny_mnist, tmp_path):
    # --quick: a few steps of the recipe, the bound and the classic loop without workers, no
    # start-up launch, and the time the full bench would take: this run's plus the steps it
    # adds (every variant's warm-up and 7 repetitions of whole epochs) at the measured pace.
    out = tmp_path / "quick.json"
    args = ["scripts/bench.py", "--quick", "--dataset", tiny_mnist, "--threads", 1, "--json", out]
    res = launch(args, launcher="python")
    assert_ok(res)
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["recipe", "bound", "classic_w0"]
    assert report["reps"] == 1 and report["startup"] == [] and report["steps_per_epoch"] == 4
    assert report["steps_per_rep"] == 4  # QUICK_STEPS, at most an epoch of 256 digits
    step = {n: min(v["seconds"]) / 4 for n, v in report["variants"].items()}
    step["classic_w1"] = step["classic_w0"]  # not run: taken at the pace of the one without
    more = sum(
        (1 + 7) * 4 * s - (2 * 4 * s if n in report["variants"] else 0) for n, s in step.items()
    )
    assert report["full_bench_estimate_s"] == pytest.approx(report["quick_s"] + more, abs=0.2)
    assert "the full bench (4 variants, 1 warm-up + 7 repetitions of 4 steps each, 3 start-up " in (
        res.output
    ), res


@pytest.mark.slow
def test_the_unet_bench_builds_the_schedule_the_recipe_names():
    from bench_tools.unet import make_scheduler
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, ReduceLROnPlateau

    from common.schedule import HeldCosine

    unet = load_recipe("unet")
    start = SimpleNamespace(epoch=1, batches_done=0, step=0)
    kinds = {
        "cosine": CosineAnnealingLR,
        "hold_cosine": HeldCosine,
        "constant": ConstantLR,
        "plateau": ReduceLROnPlateau,
    }
    assert set(kinds) == set(unet.SCHEDULERS)
    for name, kind in kinds.items():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make_scheduler(
            unet, optimizer, unet.Config(scheduler=name, epochs=2), start, 10
        )
        assert type(scheduler) is kind
        if kind is not ReduceLROnPlateau and kind is not ConstantLR:
            assert scheduler.T_max == 20  # fitted to 2 epochs of 10 steps


@pytest.mark.slow
def test_the_text_bench_holds_the_recipe_against_tfidf_on_the_same_split(text_corpus, tmp_path):
    # What a user would run instead: TF-IDF of words (or of characters) + a linear SVM or a
    # logistic regression on the documents of the recipe's own split, beside the recipe and the
    # padded loop, with the seconds each took.
    out = tmp_path / "text.json"
    args = ["scripts/bench.py", "--recipe", "text", "--dataset", text_corpus, "--reps", 1]
    args += ["--warmup", 0, "--startup_runs", 0, "--threads", 1, "--json", out]
    res = launch(args, launcher="python", env={"OMP_NUM_THREADS": "1"})
    assert_ok(res)
    report = json.loads(out.read_text())
    assert set(report["per_variant"]) == {"recipe", "bound", "classic"}
    for name, words in (
        ("tfidf_linear_svm", "word 1-2 grams + linear SVM"),
        ("tfidf_logistic", "word 1-2 grams + logistic"),
        ("tfidf_chars_linear_svm", "char 1-4 grams in words + linear SVM"),
    ):
        baseline = report[name]
        assert baseline["accuracy"] > 0.8 and baseline["seconds"] >= 0  # the classes' own words
        line = f"TF-IDF {words}: test accuracy {baseline['accuracy']:.4f}"
        assert line in res.output and line in out.with_suffix(".md").read_text()
