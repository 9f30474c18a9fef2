"""Bad input, failing ranks and exits: one clear line, a bounded time, nothing lost."""

import gc
import hashlib
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeAccelerator, _write_split, launch
from recipe_module import load_recipe

from common.config import parse_config
from common.data import DataError, require_one_batch_per_process

RECIPE = "recipes/mnist.py"


def snapshot(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def bad_datasets(tiny_mnist, tmp_path_factory):
    """Folders that are each wrong in one way."""
    import datasets

    root = tmp_path_factory.mktemp("bad_data")
    digits = np.zeros((4, 28, 28), np.uint8)
    (root / "no_test").mkdir()
    _write_split(root / "no_test" / "train.parquet", digits, [1, 2, 3, 4])
    (root / "rgb").mkdir()
    rgb = datasets.Dataset.from_dict(
        {"image": [np.zeros((28, 28, 3), np.uint8)] * 4, "label": [1, 2, 3, 4]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    for split in ("train", "test"):
        rgb.to_parquet(str(root / "rgb" / f"{split}.parquet"))
    (root / "bad_label").mkdir()
    for split in ("train", "test"):
        _write_split(root / "bad_label" / f"{split}.parquet", digits, [1, 2, 3, 4])
    ds = datasets.load_dataset(str(root / "bad_label"))["train"].cast_column(
        "label", datasets.Value("int64")
    )
    ds.map(lambda r: {"label": -3}).to_parquet(str(root / "bad_label" / "train.parquet"))
    (root / "text_label").mkdir()
    for split in ("train", "test"):
        ds.map(
            lambda r: {"label": str(r["label"])},
            features=datasets.Features(
                {"image": datasets.Image(), "label": datasets.Value("string")}
            ),
        ).to_parquet(str(root / "text_label" / f"{split}.parquet"))
    (root / "empty").mkdir()
    for split in ("train", "test"):
        _write_split(root / "empty" / f"{split}.parquet", digits[:0], [])
    return root


CASES = {
    "missing split": (["--dataset", "{bad}/no_test"], "has no 'test' split (it has train)"),
    "missing column": (["--label_column", "digit"], "has no column 'digit'"),
    "empty split": (["--dataset", "{bad}/empty"], "has an empty split"),
    "channels": (["--dataset", "{bad}/rgb"], "BasicNet takes 28x28 greyscale"),
    "label range": (["--dataset", "{bad}/bad_label"], "has label -3; labels must be 0 or more"),
    "label type": (
        ["--dataset", "{bad}/text_label"],
        "column 'label' holds Value('string'), not class indices",
    ),
    "smaller than a batch per process": (
        ["--batch_size", "1000"],
        "fewer than one batch for each process (1000 x 1 processes)",
    ),
    "mid-epoch resume": (
        ["--batch_size", "16"],
        "was written mid-epoch with batch_size 32, not 16: resume it with",
    ),
}


IN_PROCESS = [
    "missing split",
    "missing column",
    "empty split",
    "channels",
    "label range",
    "label type",
    "smaller than a batch per process",
]  # data


def case_args(case, tiny_mnist, bad_datasets):
    args, message = CASES[case]
    args = [a.format(bad=bad_datasets) for a in args]
    return (args if "--dataset" in args else ["--dataset", str(tiny_mnist), *args]), message


@pytest.mark.parametrize("case", IN_PROCESS)
def test_bad_data_is_named_with_its_fix(case, tiny_mnist, bad_datasets):
    # The message the recipe's data step gives. The launch below shows that an error that stops a
    # resume reaches the user as one line and leaves the run's files alone; test_config.py's, that
    # a data error is one line.
    args, message = case_args(case, tiny_mnist, bad_datasets)
    mnist = load_recipe("mnist")
    cfg = parse_config(mnist.Config, args)
    with pytest.raises(DataError, match=re.escape(message)):
        train_loader, _ = mnist.make_loaders(cfg)
        # What main() checks of the loaded data.
        samples = len(train_loader.dataset)
        require_one_batch_per_process(samples, cfg.batch_size, FakeAccelerator(), "the train split")


@pytest.mark.slow
def test_a_resume_that_stops_on_bad_input_is_one_line_and_the_checkpoints_survive(
    mnist_checkpoint, tiny_mnist, bad_datasets, tmp_path
):
    # The last of the checks before training (load_checkpoint): the model, the optimizer, the
    # data and the output folder are made by then. A resume path that is not there:
    # test_resume.py's test_bad_resume_choices_say_what_to_do. On a copy of the shared run, which
    # other tests read as it was written.
    args, message = case_args("mid-epoch resume", tiny_mnist, bad_datasets)
    args += ["--resume", "latest"]
    mnist_checkpoint = shutil.copytree(mnist_checkpoint, tmp_path / "run")
    before = snapshot(mnist_checkpoint / "checkpoints")
    metrics = (mnist_checkpoint / "metrics.jsonl").read_text()
    start = time.monotonic()
    res = launch(
        [RECIPE, "--output_dir", mnist_checkpoint, "--batch_size", 32, *args], launcher="python"
    )
    errors = [line for line in res.output.splitlines() if "error: " in line]
    assert res.returncode == 2 and len(errors) == 1 and message in errors[0], res
    assert "Traceback" not in res.output
    assert time.monotonic() - start < 60
    after = snapshot(mnist_checkpoint / "checkpoints")
    assert before.items() <= after.items(), "an existing checkpoint was changed or deleted"
    # A resume that stops before it trains leaves the run's metrics as they were.
    assert (mnist_checkpoint / "metrics.jsonl").read_text() == metrics


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_mnist, tmp_path):
    res = launch(
        [
            RECIPE,
            "--dataset",
            tiny_mnist,
            "--output_dir",
            tmp_path,
            "--batch_size",
            32,
            "--lr",
            "1e30",
            "--checkpoint_every_steps",
            1,
        ],
        launcher="python",
    )
    errors = [line for line in res.output.splitlines() if "error: " in line]
    assert res.returncode == 2 and len(errors) == 1, res
    assert "the loss became nan or inf at step 2; the last good checkpoint is" in errors[0]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    assert (tmp_path / "checkpoints" / "step-00000001" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_debug_shows_the_traceback(tiny_mnist, tmp_path):
    # run(), as `python recipes/mnist.py ... --debug` calls it: the error is raised, with its
    # traceback, instead of its one line. Without --debug: test_config.py's launch.
    from common.runtime import run

    mnist = load_recipe("mnist")
    argv = ["--dataset", "./nowhere", "--output_dir", str(tmp_path / "run"), "--debug"]
    try:
        with pytest.raises(DataError, match="dataset path ./nowhere does not exist"):
            run(mnist.main, mnist.Config, argv)
    finally:
        gc.unfreeze()  # run() froze what this process had made, as a recipe's process ends


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failing_rank_brings_the_job_down_quickly(mode):
    # "raise": the launcher sees rank 1 die and stops rank 0, which is waiting in a collective.
    # "hang": nothing dies; rank 0's collective times out after dist timeout (4 s here: both
    # ranks have met in the process group's rendezvous before the first collective, and the
    # timeout covers that rendezvous too, so "raise", which never waits for it, keeps 10 s).
    start = time.monotonic()
    res = launch(
        ["tests/rank_failure_probe.py", mode, 4 if mode == "hang" else 10], nproc=2, timeout=120
    )
    assert res.returncode != 0
    if mode == "raise":
        assert "rank 1 failed at step 3 (planted by the test)" in res.output, res
    else:
        assert "timed out" in res.output.lower() or "timeout" in res.output.lower(), res
    assert time.monotonic() - start < 90


def test_a_launch_accelerate_would_run_as_independent_trainings_stops_with_one_line(
    tiny_mnist, tmp_path
):
    # FSDP needs GPUs: on a machine with none, 2 processes would each train alone (README: No
    # silent independent runs).
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "distributed_type: FSDP\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\n"
    )
    res = launch(
        [RECIPE, "--dataset", tiny_mnist, "--output_dir", tmp_path / "out", "--smoke"],
        nproc=2,
        config=config,
    )
    errors = [line for line in res.output.splitlines() if line.startswith("error")]
    assert res.returncode != 0 and errors == [
        "error: distributed_type FSDP needs GPUs, and this machine has none: for several CPU "
        "processes use accelerate_configs/2gpu.yaml (DDP over gloo)"
    ], res
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_cannot_be_created_is_one_line_not_ignored(tmp_path, monkeypatch):
    # Creating output_dir fails only with the error it means (it exists already: not this run's);
    # any other, such as a disk full at that moment, stops the run where it happened.
    from types import SimpleNamespace

    from common import outputs
    from common.config import UserError

    real_mkdir = Path.mkdir

    def full_once(self, *args, **kwargs):
        monkeypatch.setattr(Path, "mkdir", real_mkdir)  # the next attempt would succeed
        raise OSError(28, "No space left on device")

    # A parent that is a file: the run cannot make its folder.
    (tmp_path / "a_file").write_text("")
    cfg = SimpleNamespace(output_dir=str(tmp_path / "a_file" / "run"), resume=None, eval_only=False)
    with pytest.raises(UserError, match=r"run is not writable \(Not a directory\): choose another"):
        outputs.open_run(SimpleNamespace(is_main_process=True), cfg)
    monkeypatch.setattr(Path, "mkdir", full_once)
    cfg = SimpleNamespace(output_dir=str(tmp_path / "run"), resume=None, eval_only=False)
    with pytest.raises(
        UserError,
        match=r"^output_dir .*run is not writable \(No space left on device\): "
        r"choose another --output_dir$",
    ):
        outputs.open_run(SimpleNamespace(is_main_process=True), cfg)
    assert not (tmp_path / "run").exists()
