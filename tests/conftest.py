"""Shared test fixtures: tiny real-digit datasets on disk, and a launcher that runs the
recipes exactly as users do (python, accelerate launch, torchrun) in a subprocess."""

import contextlib
import difflib
import fcntl
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from recipe_module import load_recipe

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SAMPLE = REPO / "data" / "mnist_sample"
N_TRAIN, N_TEST = 256, 201  # odd: never a multiple of 2 processes x any batch size used here


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def once(tmp_path_factory, name, make):
    """make(folder) run once a session into a folder of its own, however many pytest-xdist workers
    ask for it (`make test` runs 2): the first to ask makes it while the others wait, and each
    gets the same folder and what make() returned (JSON: a Result comes back as one). Shared data
    and runs are read, never changed: a test copies what it changes."""
    root = session_root(tmp_path_factory)
    folder, saved = root / "once" / name, root / "once" / f"{name}.json"
    folder.parent.mkdir(exist_ok=True)
    with open(root / "once" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not saved.exists():  # a worker whose make() failed left none: the next one tries
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            made = make(folder)
            saved.write_text(json.dumps(made, default=_as_json))
    return json.loads(saved.read_text(), object_hook=_from_json)


def session_root(tmp_path_factory):
    """The session's temporary folder, the same for every pytest-xdist worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' own base folders lie side by side in it
    return root


def _as_json(value):
    if isinstance(value, Result):
        return {"returncode": value.returncode, "output": value.output}
    if isinstance(value, Path):
        return {"path": str(value)}
    raise TypeError(value)


def _from_json(value):
    if value.keys() == {"returncode", "output"}:
        return Result(value["returncode"], value["output"])
    return Path(value["path"]) if value.keys() == {"path"} else value


class Result:
    def __init__(self, returncode, output):
        self.returncode, self.output = returncode, output

    def __repr__(self):
        return f"exit {self.returncode}\n{self.output[-4000:]}"


def launch(
    script_args, nproc=1, launcher=None, config=None, env=None, timeout=300, launcher_args=()
):
    """Run a recipe the way a user would; return its exit code and combined output.
    launcher: "python", "accelerate" or "torchrun". None: `accelerate launch` with a config or 2
    processes; else `python` on the CPU, as cpu.yaml runs it, without the launcher's 1.5 s.
    launcher_args: more arguments for accelerate launch or torchrun, such as
    ["--max-restarts", 1]."""
    script_args = [str(a) for a in script_args]
    if launcher is None:
        launcher = "accelerate" if nproc > 1 or config else "python"
        if launcher == "python":
            env = {"ACCELERATE_USE_CPU": "1", **(env or {})}
    if launcher == "python":
        assert nproc == 1
        cmd = [sys.executable, *script_args]
    elif launcher == "accelerate":
        config = config or ("cpu.yaml" if nproc == 1 else "2gpu.yaml")
        cmd = [
            BIN / "accelerate",
            "launch",
            "--config_file",
            REPO / "accelerate_configs" / config,
            "--num_processes",
            nproc,
            "--main_process_port",
            free_port(),
            *launcher_args,
            *script_args,
        ]
    elif launcher == "torchrun":
        cmd = [
            BIN / "torchrun",
            "--nproc_per_node",
            nproc,
            "--master_port",
            free_port(),
            *launcher_args,
            *script_args,
        ]
    else:
        raise ValueError(launcher)
    proc = start(cmd, env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torch elastic starts each worker in a session of its own, out of killpg's reach: kill
        # them one by one too, or a hung worker keeps the output pipe open and communicate()
        # never returns.
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{out[-4000:]}")
    return Result(proc.returncode, out)


def start(cmd, env=None, stdout=subprocess.PIPE):
    """Start `cmd` in the repository, in a session of its own as a terminal starts a job (Ctrl-C
    is os.killpg), its output (unbuffered, stderr with it) to `stdout`: the Popen."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for(predicate, proc, timeout=120):
    """Poll until predicate() is true; fail if `proc` (a start()ed one) ends first or it takes
    longer than `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            output = proc.stdout.read()[-3000:] if proc.stdout else "(output in its file)"
            pytest.fail(f"exited early with {proc.returncode}:\n{output}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def predict_here(recipe, weights, pattern, out, *more):
    """The recipe's predict() in the test process, as `--predict PATTERN --weights WEIGHTS
    --predict_dir OUT` runs it (more: other settings, such as --overlay): for tests of what
    predict writes, where the launch adds nothing (the fast tier and test_unet_predict.py launch
    it)."""
    from common.accelerator import build_accelerator
    from common.config import parse_config

    args = ["--predict", pattern, "--weights", weights, "--predict_dir", out, *more]
    serving = load_recipe(f"{recipe.NAME}_predict")  # recipes/unet_predict.py serves unet.py
    serving.predict(
        parse_config(serving.ServingConfig, [str(a) for a in args]), build_accelerator()
    )


def stopped_at(straight, step, split):
    """`split` holding only checkpoints/step-N of `straight`: what a run stopped at step N leaves
    to resume from. A checkpoint is written the same way on a stop and every N steps (a straight
    run with --checkpoint_every_steps), so one run gives both the straight weights and the
    checkpoint to resume: 2 launches where a separate stopped run made 3."""
    name = f"step-{step:08d}"
    shutil.copytree(Path(straight) / "checkpoints" / name, Path(split) / "checkpoints" / name)
    return split


def make_shapes(root, count, size, *more):
    """scripts/make_shapes.py into root: count images with exact masks, of size x size, or WxH
    ("200x120"), or with each height and width drawn from a string of sizes such as "40,64,96"
    (--sizes); `more`: its other arguments, such as "--image_format", "jpg"."""
    subprocess.run(
        [
            sys.executable,
            REPO / "scripts" / "make_shapes.py",
            "--out",
            root,
            "--count",
            str(count),
            "--sizes" if "," in str(size) else "--size",
            str(size),
            *more,
        ],
        check=True,
        capture_output=True,
    )
    return root


def make_digits(root, *args):
    """scripts/make_digits.py into root with its arguments `args`, such as "--count", "10"."""
    subprocess.run(
        [sys.executable, REPO / "scripts" / "make_digits.py", *args, "--out", root],
        check=True,
        capture_output=True,
    )
    return root


TINY_MODEL = """
class TinyNet(nn.Module):  # the user's own model
    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(28 * 28, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))

"""


# TinyNet that also writes down the ids (encode_id) of the samples of every training batch, a
# JSON line per batch in $PROBE_OUT/rank{RANK}.jsonl: what each process trains on, in its order.
RECORDING_MODEL = """
import json
import os


class TinyNet(nn.Module):  # the user's own model, which says what it trains on
    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(28 * 28, num_classes)

    def forward(self, x):
        if self.training:
            pixels = torch.round((x[:, 0, 0, :2] * 0.3081 + 0.1307) * 255).long()  # normalize()^-1
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps((pixels[:, 0] + 256 * pixels[:, 1]).tolist()) + "\\n")
        return self.fc(torch.flatten(x, 1))

"""


@contextlib.contextmanager
def copy_with_tiny_model(model=TINY_MODEL):
    """recipes/mnist.py and its serving file copied as README "Make your own recipe" says, with
    BasicNet swapped for TinyNet (`model`: its source, such as RECORDING_MODEL): the copy's path,
    both deleted on leaving."""
    original = (REPO / "recipes" / "mnist.py").read_text()
    serving = (REPO / "recipes" / "mnist_predict.py").read_text()
    name = f"my_recipe_{uuid.uuid4().hex[:8]}"
    line = "    return BasicNet(num_classes=len(classes))  # ADAPT: your model"
    assert original.count(line) == 1
    source = original.replace("# ADAPT: your model.", model + "# ADAPT: your model.")
    source = source.replace(line, "    return TinyNet(num_classes=len(classes))")
    # One line of the recipe changes, besides the model added, and one of its serving file (its
    # import of the recipe; README: Make your own recipe).
    assert changed_lines(original, source) == 1
    serving_copy = serving.replace("from mnist import", f"from {name} import")
    assert changed_lines(serving, serving_copy) == 1
    copy, served = REPO / "recipes" / f"{name}.py", REPO / "recipes" / f"{name}_predict.py"
    copy.write_text(source)
    served.write_text(serving_copy)
    try:
        yield copy
    finally:
        copy.unlink()
        served.unlink()


def changed_lines(original, copy):
    """How many lines of `original` the copy changed or removed (added lines not counted)."""
    diff = difflib.ndiff(original.splitlines(), copy.splitlines())
    return sum(line.startswith("- ") for line in diff)


def compile_config(tmp_path, base="2gpu.yaml"):
    """A copy of accelerate_configs/<base> that turns torch.compile on, as a user would."""
    path = Path(tmp_path) / f"compile-{base}"
    path.write_text(
        (REPO / "accelerate_configs" / base).read_text()
        + "dynamo_config:\n  dynamo_backend: INDUCTOR\n"
    )
    return path


def assert_ok(res):
    """Exit 0 and no abort at interpreter shutdown (the gloo 'terminate called' crash)."""
    assert res.returncode == 0, res
    assert "terminate called" not in res.output, res
    assert "Traceback" not in res.output, res


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def run_here(recipe, argv):
    """The recipe's main() through run() in this process, as `python recipes/NAME.py ARGV` calls
    it, for what a launch adds nothing to: its exit status (its one line is on stderr)."""
    from common.runtime import run

    try:
        with pytest.raises(SystemExit) as stopped:
            run(recipe.main, recipe.Config, [str(a) for a in argv])
    finally:
        gc.unfreeze()  # run() froze what this process had made, as a recipe's process ends
    return stopped.value.code


def error_lines(res):
    """The `error:` lines of a failed run; no rank may show a traceback (the launcher's own one,
    which reports the failed ranks, is not the recipe's)."""
    assert res.returncode != 0, res
    assert "DataError" not in res.output, res
    assert not re.search(r'File ".*/(recipes|common)/', res.output), res
    return [line for line in res.output.splitlines() if line.startswith("error:")]


def truncate(path):
    """Cut a file to its first half, as an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header still reads; the pixels do not


def garble(path):
    """Overwrite a file with bytes that no reader takes."""
    path.write_bytes(b"this is not an image nor a parquet file " * 20)


def assert_ema_is_evaluated_and_followed(out, steps, steps_per_epoch):
    """An MNIST run with --ema_decay 0.9: the average is not the model, it is evaluated with every
    sample, and `best` follows it."""
    import torch
    from safetensors.torch import load_file

    model, averaged = (
        load_file(Path(out) / f"{name}.safetensors") for name in ("model", "model_ema")
    )
    assert not torch.equal(model["fc2.weight"], averaged["fc2.weight"])
    rows = read_metrics(out)
    assert all(
        r["ema_eval_samples"] == r["eval_samples"] == N_TEST and 0 < r["ema_accuracy"] <= 1
        for r in rows
    )
    complete = [r["ema_accuracy"] for r in rows if r["step"] % steps_per_epoch == 0]  # whole epochs
    state = Path(out) / "checkpoints" / f"step-{steps:08d}" / "trainer_state.json"
    state = json.loads(state.read_text())
    assert state["ema_decay"] == 0.9 and state["best_ema_accuracy"] == max(complete)


# ---- Checkpoints written in the test process ----


class FakeAccelerator:
    """What save_training and resume_training ask of an Accelerator, as the main process of
    `num_processes`."""

    is_main_process = True

    def __init__(self, num_processes=1):
        import torch

        self.device, self.loaded, self.num_processes = torch.device("cpu"), None, num_processes

    def save_state(self, path):
        import pathlib

        pathlib.Path(path).mkdir(parents=True)

    def load_state(self, path):
        self.loaded = path

    def wait_for_everyone(self):
        pass

    def print(self, *args):
        pass


def saved_run(tmp_path, processes=1, **settings):
    """A checkpoint that save_training writes for mnist settings, mid-epoch after 3 batches of
    `processes` processes, with a OneCycle of 16 steps; and what resuming from it needs."""
    from types import SimpleNamespace

    import torch
    from recipe_module import load_recipe

    from common.checkpoint import save_training
    from common.progress import Progress

    mnist = load_recipe("mnist")
    cfg = mnist.Config(output_dir=str(tmp_path), epochs=2, **settings)
    accelerator = FakeAccelerator(processes)
    progress = Progress(accelerator, cfg, metric="accuracy")
    progress.epoch, progress.batches_done, progress.step = 1, 3, 3
    progress.losses = SimpleNamespace(totals=lambda accelerator: (1.5, 96))
    progress.skipped = 0
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=16)
    save_training(
        accelerator,
        cfg,
        progress=progress,
        scheduler=scheduler,
        recipe="mnist",
        data_order=mnist.DATA_ORDER,
        mask_values=[0, 255],
    )
    return mnist, cfg, optimizer, tmp_path / "checkpoints" / "step-00000003"


def _write_split(path, images, labels):
    import datasets
    from PIL import Image

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(im) for im in images], "label": [int(y) for y in labels]},
        features=features,
    )
    ds.to_parquet(str(path))


def encode_id(images):
    """Write each image's row number into two corner pixels (always 0 in MNIST)."""
    ids = np.arange(len(images))
    images[:, 0, 0], images[:, 0, 1] = ids % 256, ids // 256
    return images


def decode_id(images):
    images = np.asarray(images).reshape(len(images), 28, 28).astype(np.int64)
    return images[:, 0, 0] + 256 * images[:, 0, 1]


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory):
    """Real digits from the shipped sample: 256 train and 201 test, ids encoded in two pixels."""

    def make(root):
        import datasets

        src = datasets.load_dataset(str(SAMPLE))["train"]
        images = np.stack([np.asarray(im) for im in src["image"][: N_TRAIN + N_TEST]])
        labels = np.asarray(src["label"][: N_TRAIN + N_TEST])
        _write_split(root / "train.parquet", encode_id(images[:N_TRAIN].copy()), labels[:N_TRAIN])
        _write_split(root / "test.parquet", encode_id(images[N_TRAIN:].copy()), labels[N_TRAIN:])
        return root

    return once(tmp_path_factory, "tiny_mnist", make)


# The shared MNIST runs' settings: 2 epochs of 256 samples in batches of 32 (8 steps an epoch on
# 1 process, 4 on 2).
MNIST_RUN = ["--epochs", 2, "--batch_size", 32]


@pytest.fixture(scope="session")
def mnist_run(tiny_mnist, tmp_path_factory):
    """One `python recipes/mnist.py` run on tiny_mnist, stopped by max_steps at step 13 of 16,
    mid-epoch 2: its outputs (a metrics.jsonl line for epoch 1 and one for the partial epoch 2,
    config.yaml, model.safetensors) and checkpoints at steps 10 (mid-epoch 2: checkpoints every 5
    steps, and at each epoch's end, 2 kept) and 13. Tests read it as it is, resume from a copy of
    a checkpoint (stopped_at) or break a copy of it: (its output folder, its Result)."""

    def make(out):
        args = ["--max_steps", 13, "--checkpoint_every_steps", 5, "--keep_checkpoints", 2]
        res = launch(
            ["recipes/mnist.py", "--dataset", tiny_mnist, "--output_dir", out, *MNIST_RUN]
            + ["--eval_batch_size", 256, *args],
            launcher="python",
        )
        assert_ok(res)
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
            "step-00000010",
            "step-00000013",
        ]
        return out, res

    return tuple(once(tmp_path_factory, "mnist_checkpoint", make))


@pytest.fixture(scope="session")
def mnist_checkpoint(mnist_run):
    """mnist_run's output folder."""
    return mnist_run[0]


# The shared 2-process run's settings: its evaluation batches of 64 leave the 201 test samples
# to a padded last batch on 2 processes; 2 DataLoader workers each; the moving average.
TWO_PROCESS_RUN = [*MNIST_RUN, "--eval_batch_size", 64, "--scale_lr", "--num_workers", 2]
TWO_PROCESS_RUN += ["--ema_decay", 0.9, "--max_steps", 7]


@pytest.fixture(scope="session")
def mnist_two_processes(tiny_mnist, tmp_path_factory):
    """One 2-process `torchrun` run of recipes/mnist.py (TWO_PROCESS_RUN), stopped by max_steps
    at step 7, mid-epoch 2, with checkpoints at step 3 (mid-epoch 1), 4 (epoch 1's end), 6 and 7:
    (its output folder, its Result). test_mnist.py checks its outputs and evaluates its weights on
    1 process; test_resume.py resumes it from step 3."""

    def make(out):
        more = ["--checkpoint_every_steps", 3, "--keep_checkpoints", 5]
        res = launch(
            ["recipes/mnist.py", "--dataset", tiny_mnist, "--output_dir", out, *TWO_PROCESS_RUN]
            + more,
            nproc=2,
            launcher="torchrun",
        )
        assert_ok(res)
        return out, res

    return tuple(once(tmp_path_factory, "mnist_2p", make))


# ---- The U-Net's data and its one shared run ----

N_IMAGES, SIZE, VAL_FRACTION = 73, 48, 0.2  # `shapes`: 73 images of 48x48, a fifth to validate
# int(73 * 0.2): not a multiple of 2 processes x eval_batch_size 4, so the last batch is padded.
N_VAL = 14
VALUES = {0, 85, 170, 255}  # make_shapes.py: background, circle, rectangle, triangle
# The U-Net's settings in its tests. Small and quick on a CPU, and wide enough (16) that every
# seed tried learns every class in 10 epochs. One thread: on 2 cores a second one slows
# convolutions this small down several times.
LR = 3e-3
FAST = [
    "--base_channels",
    16,
    "--lr",
    LR,
    "--val_fraction",
    VAL_FRACTION,
    "--num_workers",
    0,
    "--eval_batch_size",
    4,
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# bucket_by_size: images of different sizes, each trained and evaluated at its own size.
N_MIXED, MIXED_SIZES = 40, "40,64,96"  # make_shapes.py --sizes: each height and width is one
N_MIXED_VAL = int(N_MIXED * VAL_FRACTION)


def relabelled(shapes, root, change, count=None, suffix=".png"):
    """A copy of the first `count` shapes whose masks are change(values, i): an array of values,
    or a PIL image, saved as NAME_mask + suffix."""
    from PIL import Image

    (root / "imgs").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, path in enumerate(sorted((shapes / "imgs").glob("*.png"))[:count]):
        Image.open(path).save(root / "imgs" / path.name)
        values = np.asarray(Image.open(shapes / "masks" / f"{path.stem}_mask.png"))
        mask = change(values, i)
        mask = mask if isinstance(mask, Image.Image) else Image.fromarray(mask)
        mask.save(root / "masks" / f"{path.stem}_mask{suffix}")
    return root


def classes(values):
    """make_shapes.py's grey levels as class indices 0..3."""
    return (values // 85).astype(np.uint8)


def with_void(values, i):
    """VOC's way: class indices, with 255 on a band along every object's edge."""
    out = classes(values)
    edge = np.zeros(values.shape, bool)
    edge[:-1] |= values[:-1] != values[1:]
    edge[:, :-1] |= values[:, :-1] != values[:, 1:]
    for axis in (0, 1):  # 3 pixels wide, so that it has an inside, as VOC's bands do
        edge |= np.roll(edge, 1, axis) | np.roll(edge, -1, axis)
    out[edge] = 255
    return out


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """The U-Net's data, made once a session: N_IMAGES shapes of SIZE x SIZE with exact masks.
    Tests read it as it is, or change a copy of it."""
    return once(tmp_path_factory, "shapes", lambda root: make_shapes(root, N_IMAGES, SIZE))


@pytest.fixture(scope="session")
def mixed_shapes(tmp_path_factory):
    """N_MIXED shapes whose heights and widths are each one of MIXED_SIZES: for bucket_by_size."""
    return once(
        tmp_path_factory, "mixed_shapes", lambda root: make_shapes(root, N_MIXED, MIXED_SIZES)
    )


@pytest.fixture(scope="session")
def unet():
    """recipes/unet.py as a module, for its Config and data functions."""
    return load_recipe("unet")


@pytest.fixture(scope="session")
def camvid_two_processes(shapes, tmp_path_factory):
    """One 2-process `accelerate launch` of recipes/unet.py on `shapes` in CamVid's layout
    (tests/layouts.py: colour masks, class_dict.csv, Void along the top), read by the flags that
    its first error names with Void ignored by name; 2 DataLoader workers each, copy-paste,
    crops, flips, zoom, rotation and colour jitter; 8 steps (4 an epoch) with checkpoints at
    steps 3 (mid-epoch 1), 4, 6 and 8. test_own_data.py checks its classes, names and colours,
    test_unet_training.py resumes it from step 3. (root, the recipe and its settings, out, its
    Result)."""

    def make(folder):
        from layouts import camvid_layout, flags_of
        from recipe_module import load_recipe

        from common.data import DataError

        root = camvid_layout(shapes, folder / "camvid")
        with pytest.raises(DataError) as error:
            load_recipe("unet").list_pairs(load_recipe("unet").Config(dataset=str(root)))
        flags = flags_of(error.value)
        assert flags[flags.index("--ignore_index") + 1] == "Void"  # class_dict.csv's, by name
        args = ["recipes/unet.py", *flags, "--lr", LR]
        args += ["--base_channels", 8, "--batch_size", 8, "--eval_batch_size", 4, "--epochs", 2]
        args += ["--num_workers", 2, "--cache_images", "false", "--crop_size", 32]
        args += ["--vflip", 0.5, "--zoom", 0.25, "--rotate", 15, "--jitter", 0.3]
        args += ["--copy_paste", 0.5]
        out = folder / "camvid_2p"
        more = ["--max_steps", 8, "--checkpoint_every_steps", 3, "--keep_checkpoints", 10]
        res = launch([*args, "--output_dir", out, *more], nproc=2, env=ONE_THREAD)
        assert_ok(res)
        return {"root": root, "args": [str(a) for a in args], "out": out, "res": res}

    return SimpleNamespace(**once(tmp_path_factory, "camvid_2p", make))


@pytest.fixture(scope="session")
def trained_unet(shapes, tmp_path_factory):
    """One single-process `python recipes/unet.py` run on `shapes`, 10 epochs: (its output folder,
    its Result). Tests check the run, and evaluate and predict with its weights."""

    def make(out):
        res = launch(
            ["recipes/unet.py", "--dataset", shapes, "--output_dir", out, "--epochs", 10, *FAST],
            launcher="python",
            env=ONE_THREAD,
        )
        assert_ok(res)
        return out, res

    return tuple(once(tmp_path_factory, "unet_1p", make))


# ---- Counting launches: most of the suite's time is the fixed cost of each one ----


def launch_processes(cmd):
    """How many processes a command started from a test launches (1 or 2, as its launcher is
    told), or 0 for a helper that imports no torch (make_shapes.py, ruff, mount)."""
    cmd = [str(c) for c in cmd]
    name = Path(cmd[0]).name
    if name in ("accelerate", "torchrun"):
        for flag in ("--num_processes", "--nproc_per_node"):
            if flag in cmd:
                return int(cmd[cmd.index(flag) + 1])
        config = cmd[cmd.index("--config_file") + 1] if "--config_file" in cmd else ""
        return 2 if "2gpu" in config else 1
    if not name.startswith("python"):
        return 0
    script = next((c for c in cmd[1:] if c.endswith(".py")), "")
    return 0 if Path(script).name.startswith("make_") else 1


class _LaunchCount:
    """Every process a test starts, by test: pytest's summary gives the total, and `--launches`
    lists them by test (docs/tests.md)."""

    def __init__(self):
        self.by_test, self.current = {}, "(collection)"

    def record(self, cmd):
        processes = launch_processes(cmd)
        if processes:
            self.by_test.setdefault(self.current, []).append(processes)


_launches = _LaunchCount()


class _CountingPopen(subprocess.Popen):
    def __init__(self, args, *more, **kwargs):
        if isinstance(args, (list, tuple)):
            _launches.record(args)
        super().__init__(args, *more, **kwargs)


def pytest_addoption(parser):
    parser.addoption(
        "--launches", action="store_true", help="list the processes each test launched"
    )


def pytest_configure(config):
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's main process: it starts the workers, which count the launches
    subprocess.Popen = _CountingPopen  # subprocess.run() and start() go through it too


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _launches.current = item.nodeid  # a session fixture's launch counts for its first test
    return (yield)


def pytest_sessionfinish(session):
    """A pytest-xdist worker sends its launches to the main pytest process, which sums them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["launches"] = json.dumps(_launches.by_test)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for test, counts in json.loads(getattr(node, "workeroutput", {}).get("launches", "{}")).items():
        _launches.by_test.setdefault(test, []).extend(counts)


def pytest_terminal_summary(terminalreporter, config):
    if config.option.collectonly:
        return
    runs = [n for counts in _launches.by_test.values() for n in counts]
    terminalreporter.write_line(
        f"launches: {len(runs)} ({runs.count(2)} of 2 processes) in {len(_launches.by_test)} "
        f"tests{'' if config.getoption('launches') else '; --launches lists them'}"
    )
    if config.getoption("launches"):
        for test, counts in sorted(_launches.by_test.items(), key=lambda kv: -len(kv[1])):
            terminalreporter.write_line(
                f"{len(counts):3d} ({counts.count(2)} of 2 processes)  {test}"
            )


@pytest.fixture(scope="session", autouse=True)
def _hf_cache(tmp_path_factory):
    """Keep the tests' datasets cache out of the user's home, and never reach for the network.
    One cache a session, as a user's machine has one: both workers' runs decode into it and read
    it (a test may read what a shared run decoded)."""
    home = session_root(tmp_path_factory) / "hf_home"
    home.mkdir(exist_ok=True)
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # closed port: hub access fails at once


# ---- The text recipe's documents ----


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory):
    """Tiny documents of two classes (text_corpus.py): N_TRAIN in train/<class>/ and N_TEST in
    test/<class>/, written once a session. Tests read them as they are, or copy them."""
    from text_corpus import N_TEST, N_TRAIN, write_corpus

    return once(tmp_path_factory, "text", lambda root: write_corpus(root, N_TRAIN, N_TEST))
