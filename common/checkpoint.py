"""Checkpoints and weights: atomic writes, exact resume, and no pickled code on load.

Training state (for resuming):

    save_checkpoint(accelerator, out / "checkpoints", step=123, trainer_state={"epoch": 2, ...})
    path = choose_checkpoint("latest", out / "checkpoints")    # None: start afresh
    trainer_state = load_checkpoint(accelerator, path, recipe="mnist")

A checkpoint is a folder `step-00000123/` holding Accelerate's save_state (model, optimizer,
prepared schedulers, grad scaler, the RNG state of every rank) and `trainer_state.json`
(epoch, batches done in that epoch, anything else the recipe needs to continue exactly).
It is written under a temporary name and renamed when complete, so a run killed while
writing leaves the previous checkpoints intact.

Weights (for inference and fine-tuning):

    save_weights(accelerator, model, out / "model.safetensors", metadata={"recipe": "mnist"})
    load_weights(model, "model.safetensors")      # also a DDP-era .pt with 'module.' keys
"""

import dataclasses
import datetime
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from accelerate.utils import gather_object, is_compiled_module
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from common.config import UserError, shell_flag
from common.schedule import fit_schedule, same_kind

# What a full disk, a quota or a lost mount raise while a file is written: safetensors reports
# an I/O error as SafetensorError, torch.save as RuntimeError ("file write failed").
WRITE_ERRORS = (OSError, SafetensorError, RuntimeError)


def _why(error, folder):
    """What stopped a write, in a few words. torch.save's error does not say, so when the disk is
    full at that moment (the partial files still on it), say that."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    try:
        if shutil.disk_usage(folder).free < 2**20:
            return "No space left on device"
    except OSError:
        pass
    return str(error).strip().splitlines()[0][:200]


def _stop_on_write_error(accelerator, problem, path, *, root=None, partial=None):
    """A collective: if writing `path` failed on any rank, the main process removes `partial`
    (what was written of it), and every rank raises one UserError that names the path and the
    problem, and where an exact resume can start."""
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        if partial is not None and accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True) if partial.is_dir() else partial.unlink(
                missing_ok=True
            )
        found = list_checkpoints(root) if root else []
        last = f"; --resume latest goes on from {found[-1]}" if found else ""
        raise UserError(
            f"cannot write {path} ({problems[0]}): free some space, or choose another "
            f"--output_dir{last}"
        )


def save_weights(accelerator, model, path, *, metadata=None):
    """Write the unwrapped model's weights from the main process, atomically (temp file + rename).
    The keys are the plain model's, also when the accelerate config compiles it (dynamo_backend).
    If the file cannot be written (a full disk), no partial file is left and every rank stops
    with one line."""
    if is_compiled_module(model):
        # Take torch.compile's wrapper off first. get_state_dict() would call unwrap_model(), which
        # (Accelerate 1.15) re-points the wrapper at the bare model: DDP would drop out of the
        # module tree that training goes on using, and its keys would carry `_orig_mod.`.
        model = model._orig_mod
    state = accelerator.get_state_dict(
        model
    )  # collective under FSDP/DeepSpeed: every rank calls it
    path, problem = Path(path), None
    tmp = path.with_name(path.name + ".tmp")
    if accelerator.is_main_process:
        state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        try:
            save_file(state, tmp, metadata={k: str(v) for k, v in (metadata or {}).items()})
            os.replace(tmp, path)
        except WRITE_ERRORS as e:
            problem = _why(e, path.parent)
    _stop_on_write_error(accelerator, problem, path, root=path.parent / "checkpoints", partial=tmp)


def _strip_prefix(state, prefix):
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix) :]: v for k, v in state.items()}
    return state


def load_weights(model, path):
    """Load weights saved by save_weights, or a torch.save'd state_dict (weights only, no code).
    path None: nothing to load (a run that starts from the model as it is made).

    Keys written by DDP-era scripts (`module.` prefix) or torch.compile (`_orig_mod.`) are accepted.
    """
    if path is None:
        return
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file {path} not found: check --weights")
    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
                state = state["model"]
    except (SafetensorError, RuntimeError, EOFError, OSError) as e:
        raise UserError(
            f"cannot read weights file {path} ({str(e).splitlines()[0]}): it is truncated or not "
            f"a weights file"
        ) from None
    state = _strip_prefix(_strip_prefix(state, "module."), "_orig_mod.")
    own = model.state_dict()
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    resized = [k for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or resized:
        if resized:
            k = resized[0]
            problem = (
                f"{len(resized)} tensors have other shapes, such as {k}: "
                f"{list(state[k].shape)} in the file, {list(own[k].shape)} in the model"
            )
        else:
            problem = f"{len(missing)} of the model's {len(own)} tensors are missing"
            problem += f", such as {missing[0]}" if missing else ""
            problem += (
                f"; {len(unexpected)} are not the model's, such as {unexpected[0]}"
                if unexpected
                else ""
            )
        raise UserError(
            f"weights in {path} do not fit this model ({problem}): were they saved by another "
            f"recipe or with other model settings?"
        )
    model.load_state_dict(state)


_NAME = re.compile(r"^step-(\d+)$")


def list_checkpoints(root):
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p for p in root.iterdir() if _NAME.match(p.name) and (p / "trainer_state.json").is_file()
    ]
    return sorted(done, key=lambda p: int(_NAME.match(p.name).group(1)))


_WROTE = "recipes/last_checkpoint"  # a key in torchrun's store: the checkpoint this job wrote last


def _job_store():
    """The key-value store of the torchrun (or accelerate launch) agent, which lives as long as
    the job, across worker restarts; None outside such a launch."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )


def save_checkpoint(accelerator, root, *, step, trainer_state, keep=3):
    """Write the full training state as root/step-NNNNNNNN, atomically; keep the newest `keep`.

    Every rank must call it (each saves its own RNG state); only the main process renames
    and deletes, and everyone waits until the checkpoint is complete before going on. If any
    rank cannot write its part (a full disk), the unfinished folder is removed, the earlier
    checkpoints stay as they were, and every rank stops with one line.
    trainer_state.json also records `step` and `world_size`, the process count: a checkpoint
    written mid-epoch resumes only on as many processes.
    """
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a run killed while writing
    accelerator.wait_for_everyone()
    problem = None
    try:
        accelerator.save_state(tmp)
        if accelerator.is_main_process:
            state = {**trainer_state, "step": step, "world_size": accelerator.num_processes}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    except WRITE_ERRORS as e:
        problem = _why(e, root)
    # A collective: also the barrier before the rename.
    _stop_on_write_error(accelerator, problem, final, root=root, partial=tmp)
    if accelerator.is_main_process:
        aside = root / f".old-{final.name}"
        if final.exists():  # the same step again (an epoch end that is also a periodic checkpoint)
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)  # set aside, not deleted, until the new one is in place
        os.replace(tmp, final)  # atomic: readers see the old checkpoints or the complete new one
        shutil.rmtree(aside, ignore_errors=True)
        store = _job_store()
        if store is not None:
            store.set(_WROTE, final.name)  # where workers that torchrun restarts continue
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def choose_checkpoint(resume, root, *, eval_only=False, restarted=False):
    """The checkpoint to continue from, or None to start afresh.

    resume: None, "latest" (the newest under root, if any) or a checkpoint folder.
    restarted: torchrun restarted the workers after a failure. If this job has written a
    checkpoint, they continue from the last one it wrote, even if --resume named an older one
    (or root holds higher-numbered ones of an abandoned run). If not (it failed before, maybe
    on the errors below), they start as the first attempt did: a restart never takes over
    another run's checkpoints. Without torchrun's store, the newest under root.
    """
    root = Path(root)
    found = list_checkpoints(root)
    if restarted and found:
        store = _job_store()
        if store is None:
            return found[-1]
        if store.check([_WROTE]) and (root / store.get(_WROTE).decode()) in found:
            return root / store.get(_WROTE).decode()
    if resume is None:
        if found and not eval_only:
            raise UserError(
                f"{root.parent} holds checkpoints of an earlier run: add --resume latest, "
                f"or pick another --output_dir"
            )
        return None
    if resume == "latest":
        if not found and eval_only:
            raise UserError(
                f"eval_only found no checkpoint in {root} to evaluate: "
                f"pass --resume with a checkpoint folder, or --weights FILE"
            )
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(
            f"resume checkpoint {path} not found: pass --resume latest or a folder under {root}"
        )
    if (
        not eval_only
        and found
        and path.resolve().parent == root.resolve()
        and found[-1].resolve() != path.resolve()
    ):
        # Going on here would mix two histories: the newer checkpoints would outrank the new
        # ones, for --resume latest and for keep_checkpoints, which would delete the new ones.
        raise UserError(
            f"{path} is older than {found[-1].name} in the same folder: to go on from it, train "
            f"into another folder ({shell_flag('resume', path)} --output_dir NEW_DIR)"
        )
    return path


def load_checkpoint(accelerator, path, *, recipe, data_order=None, same=None, exact=True):
    """Restore what save_checkpoint wrote into the prepared objects; return trainer_state.

    data_order: {setting: value} of the settings that decide which batches each rank gets,
    such as batch_size and seed, as the recipe stored them in trainer_state; None: any
    (eval_only). A checkpoint written mid-epoch resumes only with the same values and process
    count: with others, the batches skipped at resume would not be the ones already trained on.
    A checkpoint of a global_batch_size resumes with the same one on any process count and
    SPLIT settings: the place in the epoch is counted in global batches (Progress.load).
    same: {setting: value} that any checkpoint resumes only with, such as ema_decay (which
    decides what the checkpoint holds); a setting missing from trainer_state counts as off: 0,
    "", [] or False, as the type of `value` has it.
    exact: False when the run cannot go on bit for bit (exact_resume), which its line then says.
    """
    path = Path(path)
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise UserError(
            f"{path} is not a complete checkpoint (no trainer_state.json): pass another --resume"
        )
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{state_file} is corrupt: resume from an earlier checkpoint") from None
    if state.get("recipe") != recipe:
        raise UserError(
            f"checkpoint {path} was written by the {state.get('recipe')} recipe, not {recipe}"
        )
    if state.get("batches_done") and data_order is not None:
        order = dict(data_order)
        if state.get("global_batch_size"):  # then global_batch_size must be the same, below
            order = {k: v for k, v in order.items() if k not in SPLIT}
        elif state.get("world_size") != accelerator.num_processes:
            raise UserError(
                f"checkpoint {path} was written mid-epoch by {state.get('world_size')} processes: "
                f"resume it with {state.get('world_size')} processes, or from a checkpoint written "
                f"at the end of an epoch (runs with --global_batch_size resume mid-epoch on any "
                f"process count)"
            )
        for name, value in order.items():
            if name in state and state[name] != value:
                raise UserError(
                    f"checkpoint {path} was written mid-epoch with {name} {state[name]}, not "
                    f"{value}: resume it with --{name} {state[name]}, or from a checkpoint written "
                    f"at the end of an epoch"
                )
    for name, value in (same or {}).items():
        if state.get(name, type(value)()) != value:
            had, value = _as_setting(state.get(name, type(value)())), _as_setting(value)
            raise UserError(
                f"checkpoint {path} was written with {name} {had}, not {value}: "
                f"resume it with --{name} {had}, or start a new run"
            )
    try:
        accelerator.load_state(path)  # tensors via safetensors / torch.load(weights_only=True)
    except (
        RuntimeError,
        OSError,
        ValueError,
        KeyError,
        SafetensorError,
        EOFError,
        pickle.UnpicklingError,
    ) as e:
        # The first line that says something: load_state_dict's starts "Error(s) in loading".
        first = [
            line.strip()
            for line in str(e).splitlines()
            if line.strip() and "Error(s) in" not in line
        ][:1]
        raise UserError(
            f"cannot load checkpoint {path} ({first[0][:200] if first else type(e).__name__}): "
            f"it is truncated or was saved with other model settings; resume from another "
            f"checkpoint"
        ) from None
    inexact = "" if exact else "; not bit-exact on a GPU without --deterministic true"
    accelerator.print(
        f"resumed from {path} (epoch {state.get('epoch')}, step {state.get('step')}){inexact}"
    )
    return state


def exact_resume(device_type, deterministic):
    """Whether a run resumed on this device goes on bit for bit as an uninterrupted one would.
    On a CUDA GPU only with deterministic (common/determinism.py): cuDNN's autotuner may pick
    other convolution algorithms in the resumed process, and some kernels add in varying order,
    so at the default neither a resume nor a second run matched on an H100 (2026-11-25,
    docs/resume.md). CPUs resume exactly either way (tested)."""
    return device_type != "cuda" or deterministic


def _as_setting(value):
    """A value as the command line gives it: a list as 0,85,170."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value


# Settings that decide what any checkpoint holds: it resumes only with the same values.
SAME_ON_RESUME = ("ema_decay",)
# Settings that only split a global batch (global_batch_size) between the processes and their
# accumulation steps: a mid-epoch checkpoint of one resumes with others, as with another count.
SPLIT = ("batch_size", "gradient_accumulation_steps")


def save_training(accelerator, cfg, *, progress, scheduler, recipe, data_order, **extras):
    """Every rank: a checkpoint of the run where `progress` is, under output_dir/checkpoints.

    What it holds, besides Accelerate's state, is listed here once, and resume_training checks
    and restores each: the recipe's name; the `data_order` settings (those that fix each rank's
    batches); SAME_ON_RESUME; the recipe's `extras` (such as the U-Net's mask values), which a
    resume needs the same; where the run is (Progress.state()); and the LR schedule."""
    settings = {k: getattr(cfg, k) for k in (*data_order, *SAME_ON_RESUME)}
    state = {
        "recipe": recipe,
        **settings,
        **extras,
        **progress.state(),
        "scheduler": scheduler.state_dict(),
    }
    save_checkpoint(
        accelerator,
        progress.checkpoints,
        step=progress.step,
        trainer_state=state,
        keep=cfg.keep_checkpoints,
    )


def resume_training(accelerator, path, cfg, *, progress, scheduler, recipe, data_order, **extras):
    """Continue from what save_training wrote at `path`, with one line for each way it does
    not fit this run: another recipe; for a mid-epoch checkpoint, other data_order settings or
    another process count (eval_only reads any); other SAME_ON_RESUME settings or `extras`; a
    schedule of another kind. Restores the prepared objects, `scheduler` and `progress`, and
    returns trainer_state. Then common.schedule.fit_schedule fits the schedule to the plan."""
    order = None if cfg.eval_only else {k: getattr(cfg, k) for k in data_order}
    same = {**{k: getattr(cfg, k) for k in SAME_ON_RESUME}, **extras}
    # Evaluating trains nothing on, so only a training run's line says whether it is exact.
    exact = cfg.eval_only or exact_resume(accelerator.device.type, cfg.deterministic)
    state = load_checkpoint(
        accelerator, path, recipe=recipe, data_order=order, same=same, exact=exact
    )
    if not cfg.eval_only:  # evaluating steps no schedule
        scheduler.load_state_dict(same_kind(scheduler, state["scheduler"], path))
    progress.load(state)
    # Accelerate counts the batches of an accumulation group from its saved count, which is this
    # run's only if the split is the checkpoint's.
    accelerator.step = progress.batches_done
    return state


def resume_or_start(
    accelerator,
    checkpoint,
    cfg,
    *,
    progress,
    scheduler,
    batches_per_epoch,
    recipe,
    data_order,
    **extras,
):
    """Where training starts: from `checkpoint` when there is one (resume_training: the weights,
    optimizer, every rank's RNG, the LR schedule and the place in the data), then with the LR
    schedule fitted to end where the run ends (common.schedule.fit_schedule), resumed or not."""
    if checkpoint:  # eval_only reads any checkpoint; training on needs the same data order
        resume_training(
            accelerator,
            checkpoint,
            cfg,
            progress=progress,
            scheduler=scheduler,
            recipe=recipe,
            data_order=data_order,
            **extras,
        )
    fit_schedule(
        scheduler, cfg, progress, batches_per_epoch=batches_per_epoch, checkpoint=checkpoint
    )


def save_best(accelerator, progress, result, *, model, ema, out, metadata):
    """out/best.safetensors when `result`, the evaluation after the epoch that progress.end_epoch()
    just completed, is the best so far (progress.improved, which also counts evaluations for early
    stopping): the weights' moving average with ema. It records `metadata`, that epoch and the
    result's numbers."""
    if progress.improved(result):
        numbers = {k: v for k, v in result.items() if not isinstance(v, dict)}
        save_weights(
            accelerator,
            ema.module if ema else model,
            Path(out) / "best.safetensors",
            metadata={**metadata, "epoch": progress.epoch - 1, **numbers},
        )


def save_final(accelerator, model, ema, out, *, metadata):
    """The trained weights: out/model.safetensors, and with ema the weights' moving average,
    out/model_ema.safetensors; both record `metadata`."""
    save_weights(accelerator, model, Path(out) / "model.safetensors", metadata=metadata)
    if ema is not None:
        save_weights(
            accelerator, ema.module, Path(out) / "model_ema.safetensors", metadata=metadata
        )


def record_metadata(key, record, **more):
    """save_weights() metadata holding `record` under `key`: a JSON-able dict of what inference
    needs besides the tensors (the model's settings, its classes, its input size), stored as one
    JSON entry so that it reads back typed; `more`: other entries beside it."""
    return {key: json.dumps(record), **more}


def read_record(path, key):
    """The record that record_metadata() stored under `key` in a .safetensors weights file, or in
    an .onnx file exported from one (common/export.py copies the metadata); None if the file holds
    none or is neither (a torch.save'd state_dict), or no file is given (None)."""
    if path is None:
        return None
    path = Path(path)
    if path.suffix not in (".safetensors", ".onnx") or not path.is_file():
        return None  # load_weights reports a missing file
    if path.suffix == ".onnx":
        from common.export import onnx_metadata

        meta = onnx_metadata(path)
    else:
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except SafetensorError as e:
            raise UserError(
                f"cannot read weights file {path} ({e}): it is truncated or not a weights file"
            ) from None
    return json.loads(meta[key]) if key in meta else None


def fit_to_record(cfg, stored, names, *, path, inferred):
    """cfg with the model settings `names` that the weights at `path` were trained with
    (`stored`: the record's model settings): a setting of `inferred` left at 0 (from the data,
    such as num_classes) takes the stored value; one that differs stops with a line naming it."""
    changes = {}
    for name in names:
        given = getattr(cfg, name)
        if name in inferred and given == 0:
            changes[name] = stored[name]
        elif stored[name] != given:
            raise UserError(
                f"{path} was trained with {name} {stored[name]}, not {given}: add "
                f"--{name} {stored[name]}"
            )
    return dataclasses.replace(cfg, **changes)
