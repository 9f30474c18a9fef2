"""Starting and stopping a run: the Accelerator, the output folder, user errors, a clean exit.

def main(cfg):
    accelerator = accelerator_for(cfg)                # build_accelerator() with cfg's settings
    out, checkpoint = open_run(accelerator, cfg)      # output_dir, and what to resume from
    ...data...
    metrics = start_logging(accelerator, cfg, "mnist")  # config.yaml, trackers, metrics.jsonl
    ...training...
    del model, optimizer, train_loader, test_loader
    close(accelerator)

if __name__ == "__main__":
    run(main, Config)
"""

import dataclasses
import datetime
import errno
import fcntl
import functools
import gc
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import accelerate.optimizer
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, gather_object

from common.checkpoint import choose_checkpoint
from common.config import ShowHelp, UserError, parse_config, save_config
from common.metrics import MetricsLog
from common.signals import stop_was_requested


def build_accelerator(
    gradient_accumulation_steps=1, seed=0, timeout_s=600, log_with="none", **kwargs
):
    """An Accelerator whose process count is what the launcher asked for, logging to the tracker
    that the log_with setting names (checked first: see tracker()).

    Machine settings (processes, precision, machines) come from the accelerate config,
    never from here. Three things are decided here:
    - on a machine with no GPU, a multi-process launch runs real DDP over gloo on the CPU.
      Without this, Accelerate quietly starts N independent single-process trainings. An FSDP
      config there stops with an error instead, and so does, on GPUs, a launch whose process
      count Accelerate does not see.
    - the data order is a function of (seed, epoch) only (`use_seedable_sampler`), so it is
      the same on every rank, changes every epoch, and can be replayed on resume.
    - prepared loaders copy batches to the GPU with non_blocking=True. A blocking copy from
      the CPU makes PyTorch wait until the GPU has finished all the work queued so far, once
      per batch, so the GPU idles while Python fetches the next batch. Give such loaders
      pin_memory=True: only a copy from pinned memory is truly asynchronous.
    """
    _ask_for_lomo_once()
    log_with = tracker(log_with)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_ddp = world_size > 1 and not torch.cuda.is_available()
    if cpu_ddp and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise UserError(
            "distributed_type FSDP needs GPUs, and this machine has none: for several CPU "
            "processes use accelerate_configs/2gpu.yaml (DDP over gloo)"
        )
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        raise UserError(
            f"the launcher starts {local_processes} processes on this machine but only "
            f"{torch.cuda.device_count()} GPU(s) are visible: set num_processes to the GPU count"
        )
    if elastic_restart():
        _init_process_group_after_restart(cpu_ddp, timeout_s)
    accelerator = Accelerator(
        cpu=cpu_ddp,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=seed, non_blocking=True
        ),
        # A rank that dies mid-collective brings the others down after this long, not never.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
        log_with=log_with,
        **kwargs,
    )
    if accelerator.num_processes != world_size:
        raise UserError(
            f"the launcher started {world_size} processes but Accelerate sees {accelerator.num_processes}: "
            f"each would train alone. Check the accelerate config (distributed_type, num_processes)"
        )
    return accelerator


PATCHED_ON = "1.15."  # the Accelerate release whose internals _ask_for_lomo_once was measured on


def accelerator_for(cfg):
    """build_accelerator() with a run's settings (a RunConfig): gradient_accumulation_steps, seed
    (the data order), dist_timeout_s, log_with, and output_dir for the trackers' files."""
    return build_accelerator(
        cfg.gradient_accumulation_steps,
        cfg.seed,
        cfg.dist_timeout_s,
        cfg.log_with,
        project_dir=cfg.output_dir,
    )


def _ask_for_lomo_once():
    """Accelerate 1.15's optimizer.step() asks importlib twice per step whether the lomo_optim
    package is installed, a cost that shows on small models (docs/performance.md). The answer
    cannot change while the job runs, so remember it. Only on 1.15: another release may not ask,
    or may ask something else under that name, so it runs as it is."""
    if not accelerate.__version__.startswith(PATCHED_ON):
        return
    check = getattr(accelerate.optimizer, "is_lomo_available", None)
    if check is not None and not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


def _init_process_group_after_restart(cpu, timeout_s):
    """After torchrun restarts its workers (--max-restarts), `init_process_group()` reads the
    previous attempt's addresses from the agent's store and fails to connect. Give every
    attempt its own key prefix; Accelerate then uses this process group as it is."""
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # log_with value -> package it needs


def tracker(log_with):
    """The `log_with` setting as Accelerate takes it (None for "none"), checked before the run
    starts: a missing package is a one-line error, not a failure at the first log call."""
    if log_with == "none":
        return None
    if log_with not in TRACKERS:
        raise UserError(f"log_with must be none, {' or '.join(TRACKERS)}, got {log_with!r}")
    import importlib.util

    if importlib.util.find_spec(TRACKERS[log_with]) is None:
        hint = "-r requirements-extras.txt" if log_with == "tensorboard" else TRACKERS[log_with]
        raise UserError(
            f"log_with {log_with} needs the {TRACKERS[log_with]} package: pip install {hint}"
        )
    return log_with


def describe(accelerator, batch):
    """One line: where and how this run trains. batch: the batch size per process, or a text
    that says what a batch is (bucketed batches)."""
    precision = accelerator.mixed_precision
    if precision == "fp16" and accelerator.device.type == "cpu":
        precision = "fp16 requested, but the CPU runs fp16 configs in fp32 (use bf16 on CPU)"
    backend = f", {accelerator.state.backend}" if accelerator.num_processes > 1 else ""
    dynamo = accelerator.state.dynamo_plugin  # the accelerate config's dynamo_config
    compiled = ""
    if dynamo.backend.value != "NO":
        mode = f" mode {dynamo.mode}" if dynamo.mode not in (None, "default") else ""
        compiled = f", torch.compile backend {dynamo.backend.value.lower()}{mode}"
    if isinstance(batch, int):
        per_step = batch * accelerator.num_processes * accelerator.gradient_accumulation_steps
        batch = f"batch {batch} per process = {per_step} per optimizer step"
    return (
        f"{accelerator.num_processes} process(es) on {accelerator.device.type}{backend}, "
        f"precision {precision}{compiled}, {batch}"
    )


def sync_batchnorm(model, accelerator, enabled):
    """The model with SyncBatchNorm where it works (several processes on GPUs; Accelerate leaves
    BatchNorm per process), and a few words saying which BatchNorm the run uses."""
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return model, "no BatchNorm"
    if accelerator.num_processes == 1:
        return model, "BatchNorm"
    if enabled and accelerator.device.type != "cpu":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), "SyncBatchNorm"
    return (
        model,
        f"BatchNorm per process ({'SyncBatchNorm needs GPUs' if enabled else 'sync_bn is off'})",
    )


def close(accelerator):
    """End trackers and the process group, after everything that uses it is gone.

    The DDP-wrapped model and the prepared loaders hold the process group. If they are still
    alive when it is destroyed, gloo's threads can die during interpreter shutdown and the
    process aborts ("terminate called without an active exception"). So the caller deletes
    its own references first; here Accelerate's references go and the garbage is collected.
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def make_output_dir(path):
    """Create output_dir, or stop with one line if it cannot be written."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise _not_writable(path, e) from None
    return path


def _not_writable(path, error):
    return UserError(
        f"output_dir {path} is not writable ({error.strerror}): choose another --output_dir"
    )


def raise_if_any(accelerator, problem):
    """A collective: every rank passes its own problem (a message, or None); if any rank has
    one, every rank raises UserError with the first, so none waits for a rank that stopped."""
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        raise UserError(problems[0])


def lock_output_dir(accelerator, out):
    """Hold a lock on output_dir/.lock while the run lives, so a second run into the same
    folder stops at once instead of mixing its checkpoints and metrics with the first. A POSIX
    lock: the system releases it when the process ends, also after a crash or a kill, and
    DataLoader workers forked later do not inherit it. True on the process that holds it."""
    problem, locked = None, False
    if accelerator.is_main_process:
        lock = open(out / ".lock", "a+")
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks
                print(
                    f"warning: cannot lock {out} ({e.strerror}): nothing stops a second run into it",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                lock.seek(0)
                owner = lock.read().strip() or "another process"
                problem = (
                    f"output_dir {out} is in use by a run that is still going ({owner}): wait for "
                    f"it to end, or choose another --output_dir"
                )
        else:
            lock.truncate(0)
            lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
            lock.flush()
            _locks.append(lock)  # held open, so held locked, until the process exits
            locked = True
    raise_if_any(accelerator, problem)
    return locked


# Only this module changes these two lists.
_locks = []  # the open lock files of lock_output_dir
_created = []  # output folders that open_run created and locked: leave_output_dir may remove them

# In a folder that open_run created, until training starts: a user error before then removes it.
UNTRAINED = ".untrained"


def training_started(output_dir):
    """From here on a failed run keeps output_dir: Progress calls this as an epoch starts."""
    (Path(output_dir) / UNTRAINED).unlink(missing_ok=True)


def leave_output_dir(failed):
    """At the end of the process: remove the folder that open_run created for this run if the run
    `failed` with a user error before it started training; else keep it, without the marker.
    A folder that existed before the run is never removed."""
    for folder in _created:
        if failed and (folder / UNTRAINED).exists():
            shutil.rmtree(folder, ignore_errors=True)
        else:
            (folder / UNTRAINED).unlink(missing_ok=True)


def open_run(accelerator, cfg):
    """The output folder, created and locked for this run, and the checkpoint to continue from
    (None: start afresh). Bad resume input stops here, before any data is read."""
    if cfg.resume == "latest" and not Path(cfg.output_dir).is_dir() and not elastic_restart():
        raise UserError(
            f"resume latest: output_dir {cfg.output_dir} does not exist: check --output_dir, or "
            f"leave out --resume to start a new run"
        )
    created = False
    if accelerator.is_main_process:
        try:
            Path(cfg.output_dir).mkdir(parents=True)  # fails if it exists: then it is not ours
            created = True
        except FileExistsError:
            pass
        except OSError as e:  # a parent that is a file, no permission, a full or read-only disk
            raise _not_writable(cfg.output_dir, e) from None
    out = make_output_dir(cfg.output_dir)
    if created:  # marked before any rank can start training, which removes the mark
        (out / UNTRAINED).touch()
    if lock_output_dir(accelerator, out) and created:  # in use by another run: not ours to remove
        _created.append(out)
    checkpoint = choose_checkpoint(
        cfg.resume, out / "checkpoints", cfg.eval_only, restarted=elastic_restart()
    )
    if cfg.resume == "latest" and not checkpoint:
        accelerator.print(
            f"resume latest: no checkpoint in {out / 'checkpoints'} yet, so training starts at step 0"
        )
    return out, checkpoint


def start_logging(accelerator, cfg, name):
    """Write config.yaml (the settings as resolved, so --config repeats the run), start the
    trackers that log_with names, and return the metrics.jsonl writer. eval_only keeps the
    training run's config.yaml."""
    out = Path(cfg.output_dir)
    if accelerator.is_main_process and not cfg.eval_only:
        save_config(cfg, out / "config.yaml")
    accelerator.init_trackers(
        name, config=dataclasses.asdict(cfg)
    )  # nothing unless log_with says so
    return MetricsLog(out / "metrics.jsonl", accelerator.is_main_process, accelerator.num_processes)


def _rank():
    return int(os.environ.get("RANK", "0"))


def elastic_restart():
    """True when torchrun restarted the workers after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _stop_loader_workers():
    """Stop the DataLoader workers of every live loader iterator now, while each is whole.

    After an error the iterators sit in a reference cycle with the traceback. gc.collect()
    would clear their queues before their __del__ runs, so the stop message never reaches a
    worker and torch waits 5 s for each one: a data error found by a worker made the process
    linger 10 s after its error line."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    for obj in gc.get_objects():
        if type(obj) is _MultiProcessingDataLoaderIter:  # isinstance() would wake lazy modules
            obj._shutdown_workers()


def run(main, config_class, argv=None):
    """Parse the config, call main(cfg), and turn user errors into one line and exit status 2.

    Once the recipe calls common.signals.catch_stop_signals(), Ctrl-C and SIGTERM only set a flag
    that the training loop polls, so it can write a checkpoint and exit cleanly on every rank
    (status 130).

    A UserError (bad config, bad data) usually happens on every rank, so rank 0 prints it and
    the others wait a moment for the launcher to stop them.
    `--debug` shows the full traceback instead. Other exceptions keep their traceback.
    """
    debug = "--debug" in (sys.argv if argv is None else argv)
    # What the imports made (torch, accelerate: about 400,000 objects) lives until the process
    # ends. Out of the collector's sight, the full collections in close() and below, which drop
    # the DDP model before the process group, take a few ms each instead of 0.15 s.
    gc.freeze()
    failed = False
    try:
        main(parse_config(config_class, argv))
    except ShowHelp as e:  # --help or -h
        print(e)
        code = 0
    except UserError as e:
        if debug:
            raise
        failed = True
        message = str(e)
        if message.startswith("Caught ") and "Original Traceback" in message:
            # Raised in a DataLoader worker: torch re-raises it with the worker's traceback.
            message = message.strip().splitlines()[-1].split(": ", 1)[-1]
        if _rank() != 0:
            # Rank 0 usually fails the same way and prints it, and the launcher then stops this
            # process. If rank 0 did not fail (the error is this rank's own), say it after a moment.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3)
        print(
            f"error: {message}" if _rank() == 0 else f"error (rank {_rank()}): {message}",
            file=sys.stderr,
            flush=True,
        )
        code = 2
    else:
        code = 130 if stop_was_requested() else 0  # 128 + SIGINT: stopped early, but cleanly
    finally:
        # After a user error the output folder goes, if this run made it and never trained.
        leave_output_dir(failed)
        # On the error path the traceback keeps main's locals (the DDP model) alive: drop them
        # before the process group goes, for the same reason as in close().
        sys.last_traceback = None
        _stop_loader_workers()
        gc.collect()
        if PartialState._shared_state and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # What main made (torch._dynamo, which the optimizer imports; the data) out of sight too:
        # the interpreter's own collections at exit would walk it all, 0.4 s of every exit.
        gc.freeze()
    sys.exit(code)
