"""One owner for each invariant (issue 24): small in-process checks of common/ and the recipes'
shape. The behaviours themselves are tested by launching the recipes, in the other files."""

import inspect
import re

import accelerate
import accelerate.optimizer
import pytest
from conftest import FakeAccelerator, saved_run

from common.accelerator import _ask_for_lomo_once, _read_zero_grad_signature_once


def test_the_accelerate_patches_apply_only_on_the_release_they_were_measured_on(monkeypatch):
    def is_lomo_available():
        return False

    for version, patched in (("1.15.0", True), ("1.16.0", False), ("1.1.5", False)):
        monkeypatch.setattr(accelerate, "__version__", version)
        monkeypatch.setattr(accelerate.optimizer, "is_lomo_available", is_lomo_available)
        monkeypatch.setattr(accelerate.optimizer, "inspect", inspect)
        _ask_for_lomo_once()
        _read_zero_grad_signature_once()
        assert hasattr(accelerate.optimizer.is_lomo_available, "cache_info") == patched, version
        assert (accelerate.optimizer.inspect is not inspect) == patched, version
    assert accelerate.optimizer.is_lomo_available is is_lomo_available  # 1.1.5 left it alone


@pytest.mark.slow
def test_a_prepared_optimizer_reads_its_zero_grad_signature_once(monkeypatch):
    # Accelerate 1.15 read it with inspect.signature at every zero_grad(), every step.
    import torch

    from common.accelerator import build_accelerator

    read = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn: read.append(fn) or signature(fn))
    monkeypatch.setattr(accelerate.optimizer, "inspect", inspect)  # as a new process has it
    accelerator = build_accelerator()
    model = torch.nn.Linear(3, 2)
    for optimizer in (torch.optim.Adadelta, torch.optim.AdamW):
        prepared = accelerator.prepare(optimizer(model.parameters()))
        for _ in range(3):
            model(torch.ones(1, 3)).sum().backward()
            prepared.step()
            prepared.zero_grad()
            assert all(p.grad is None for p in model.parameters())  # set_to_none, as before
    # Once in 6 steps: both optimizers have torch's Optimizer.zero_grad.
    assert sum(getattr(fn, "__name__", "") == "zero_grad" for fn in read) == 1


@pytest.mark.slow
def test_a_batch_of_indices_becomes_a_tensor_without_torch_as_tensor_of_a_list(monkeypatch):
    # torch.as_tensor of the sampler's list of 64 ints took 35-45 us a batch on a loaded core,
    # numpy's 3 (docs/performance.md, "Per-step host work"); the batch is the same.
    import torch

    from common.data import TensorBatches, seeded_loader

    images = torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1).repeat(1, 1, 2, 2)
    labels = torch.arange(100)  # each sample's row
    loader = seeded_loader(TensorBatches(images, labels), 16, shuffle=True, seed=0)
    calls = []
    as_tensor = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: calls.append(a) or as_tensor(*a, **k))
    rows = []
    for x, y in loader:
        assert torch.equal(x, images[y]) and y.dtype == torch.int64
        rows += y.tolist()
    assert sorted(rows) == list(range(100)) and rows != sorted(rows)  # each once, shuffled
    assert not [a for a in calls if isinstance(a[0], list)], calls[:1]


def test_stop_signals_are_caught_only_once_the_recipe_says_so(tmp_path, monkeypatch):
    import os
    import signal
    from types import SimpleNamespace

    import torch
    from recipe_module import load_recipe

    from common import signals
    from common.progress import Progress

    monkeypatch.setattr(signals, "_stop", signals._StopRequest())
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Starting an epoch is bookkeeping only: Ctrl-C still acts as usual.
        cfg = load_recipe("mnist").Config(output_dir=str(tmp_path))
        accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
        Progress(accelerator, cfg, metric="accuracy").start_epoch(8)
        assert {sig: signal.getsignal(sig) for sig in before} == before
        assert not signals.stop_was_requested()
        signals.catch_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once: a flag, not an exit
        assert signals.stop_was_requested()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_one_pair_writes_and_checks_what_a_checkpoint_holds(tmp_path):
    import json

    import pytest
    import torch

    from common.checkpoint import SAME_ON_RESUME, resume_training
    from common.config import UserError
    from common.progress import Progress

    mnist, cfg, optimizer, path = saved_run(tmp_path)
    state = json.loads((path / "trainer_state.json").read_text())
    for key in (
        "recipe",
        *mnist.DATA_ORDER,
        *SAME_ON_RESUME,
        "mask_values",
        "scheduler",
        "epoch",
        "batches_done",
        "step",
        "epoch_so_far",
    ):
        assert key in state, key
    assert state["mask_values"] == [0, 255] and state["scheduler"]["total_steps"] == 16

    def resume(cfg, scheduler=None, **extras):
        scheduler = scheduler or torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=16)
        progress = Progress(FakeAccelerator(), cfg, metric="accuracy")
        resume_training(
            FakeAccelerator(),
            path,
            cfg,
            progress=progress,
            scheduler=scheduler,
            recipe="mnist",
            data_order=mnist.DATA_ORDER,
            **{"mask_values": [0, 255], **extras},
        )
        return progress, scheduler

    progress, scheduler = resume(cfg)
    assert (progress.epoch, progress.batches_done, progress.step) == (1, 3, 3)
    assert scheduler.total_steps == 16
    cases = [
        (
            cfg.__class__(**{**vars(cfg), "batch_size": 32}),
            {},
            "was written mid-epoch with batch_size 64, not 32: resume it with --batch_size 64",
        ),
        (
            cfg.__class__(**{**vars(cfg), "ema_decay": 0.9}),
            {},
            "was written with ema_decay 0.0, not 0.9: resume it with --ema_decay 0.0, or start a "
            "new run",
        ),
        (
            cfg,
            {"mask_values": [0, 128, 255]},
            "was written with mask_values 0,255, not 0,128,255: resume it with --mask_values "
            "0,255, or start a new run",
        ),
    ]
    for other, extras, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            resume(other, **extras)
    step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(
        UserError,
        match=re.escape(
            "has a onecycle schedule of 16 steps, this run plans "
            "a step schedule: resume with the scheduler"
        ),
    ):
        resume(cfg, step)
    evaluated, _ = resume(
        cfg.__class__(**{**vars(cfg), "eval_only": True, "batch_size": 32, "resume": "latest"}),
        step,
    )  # eval_only reads any
    assert evaluated.step == 3


def test_one_schedule_policy_refits_a_cosine_and_refuses_a_onecycle_whose_plan_changed(tmp_path):
    import math
    from types import SimpleNamespace

    import pytest
    import torch
    from recipe_module import load_recipe

    from common.config import UserError
    from common.schedule import HeldCosine, fit_schedule, same_kind

    cfg = load_recipe("mnist").Config(epochs=2)
    here = SimpleNamespace(epoch=2, batches_done=0, step=8)  # the end of epoch 1 of 8 steps
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    onecycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=16)
    fit_schedule(onecycle, cfg, here, batches_per_epoch=8)  # the same plan: goes on
    for changed, batches in (
        (cfg.__class__(epochs=3), 8),
        (cfg, 16),
    ):  # more epochs; 1 of 2 processes
        with pytest.raises(
            UserError,
            match=re.escape(
                "has a onecycle schedule of 16 steps, this run plans a onecycle schedule of"
            ),
        ):
            fit_schedule(
                onecycle, changed, here, batches_per_epoch=batches, checkpoint="step-00000008"
            )
    evaluates_only = cfg.__class__(epochs=3, eval_only=True, resume="x")
    fit_schedule(onecycle, evaluates_only, here, batches_per_epoch=8)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1)
    fit_schedule(cosine, cfg, SimpleNamespace(epoch=1, batches_done=0, step=0), batches_per_epoch=8)
    assert cosine.T_max == 16
    for _ in range(8):
        optimizer.step()
        cosine.step()
    fit_schedule(cosine, cfg, here, batches_per_epoch=16)  # now 16 steps an epoch: ends at 24
    assert cosine.T_max == 24
    assert optimizer.param_groups[0]["lr"] == pytest.approx((1 + math.cos(math.pi * 8 / 24)) / 2)
    # The held cosine (the U-Net's hold_cosine): the lr held for a share of the plan, then the
    # cosine; refitted the same way, its held share of the new plan; never loaded from a cosine.
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    held = HeldCosine(optimizer, hold=0.5)
    fit_schedule(held, cfg, SimpleNamespace(epoch=1, batches_done=0, step=0), batches_per_epoch=8)
    lrs = []
    for _ in range(12):
        optimizer.step()
        held.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[:8] == [1.0] * 8  # steps 1 to 8 of 16: held
    assert lrs[11] == pytest.approx((1 + math.cos(math.pi * 4 / 8)) / 2)  # step 12: half-way down
    at_12 = SimpleNamespace(epoch=2, batches_done=4, step=12)
    fit_schedule(held, cfg.__class__(epochs=4), at_12, batches_per_epoch=8)  # now ends at 32
    assert held.T_max == 32 and optimizer.param_groups[0]["lr"] == 1.0  # held to step 16 of 32
    with pytest.raises(UserError, match="has a cosine schedule, this run plans a held cosine"):
        same_kind(held, cosine.state_dict(), "step-00000008")


def common_names_in_main(source):
    """The distinct names imported from common.* that a recipe's main() uses."""
    import ast

    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common")
        for alias in node.names
    }
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return {n.id for n in ast.walk(main) if isinstance(n, ast.Name) and n.id in imported}


def test_each_recipe_main_catches_stop_signals_in_one_visible_line():
    from conftest import REPO

    for recipe in ("mnist", "unet", "text"):
        names = common_names_in_main((REPO / "recipes" / f"{recipe}.py").read_text())
        assert "catch_stop_signals" in names, recipe


@pytest.mark.slow
def test_a_resume_on_a_gpu_says_that_only_deterministic_mode_is_bit_exact(tmp_path):
    # On an H100 (2026-11-25) neither a resume nor a second run matched at the default; with
    # --deterministic true both did. The line is tested by its code path: only the device's type
    # is a GPU's here.
    import torch

    from common.checkpoint import resume_training
    from common.progress import Progress

    mnist, cfg, optimizer, path = saved_run(tmp_path)
    lines = {}
    for device, deterministic, eval_only in (
        ("cpu", False, False),
        ("cuda", False, False),
        ("cuda", True, False),
        ("cuda", False, True),
    ):
        accelerator = FakeAccelerator()
        accelerator.device, said = torch.device(device), []
        accelerator.print = said.append
        run = cfg.__class__(**{**vars(cfg), "deterministic": deterministic, "eval_only": eval_only})
        resume_training(
            accelerator,
            path,
            run,
            progress=Progress(accelerator, run, metric="accuracy"),
            scheduler=torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=16),
            recipe="mnist",
            data_order=mnist.DATA_ORDER,
            mask_values=[0, 255],
        )
        (lines[device, deterministic, eval_only],) = said
    resumed = f"resumed from {path} (epoch 1, step 3)"
    assert lines["cuda", False, False] == (
        f"{resumed}; not bit-exact on a GPU without --deterministic true"
    )
    # On a CPU, in deterministic mode, and when it only evaluates, nothing more.
    assert lines["cpu", False, False] == lines["cuda", True, False] == resumed
    assert lines["cuda", False, True] == resumed


def test_no_unwrap_takes_ddp_out_of_a_compiled_model():
    # Accelerate 1.15's unwrap_model() re-points torch.compile's wrapper at the bare model unless
    # keep_torch_compile=False: a compiled DDP model would train on without DDP, each process on
    # its own gradients (tests/compile_probe.py shows it for the U-Net). Any call in common/ or
    # the recipes says keep_torch_compile=False, or unwraps a model before prepare() needs to.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    calls = []
    for path in sorted([*root.glob("common/*.py"), *root.glob("recipes/*.py")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "unwrap_model(" in line and not line.lstrip().startswith("#"):
                calls.append((f"{path.relative_to(root)}:{number}", line.strip()))
    assert calls, "no unwrap_model() call found: the check reads nothing"
    bare = [where for where, line in calls if "keep_torch_compile=False" not in line]
    assert not bare, f"unwrap_model() without keep_torch_compile=False at {bare}"
