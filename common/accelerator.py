"""The Accelerator of a run: built for the launch and the accelerate config, described in one
line, and closed cleanly.

    cfg = cfg.split_global_batch(launched_processes())  # global_batch_size: batch and accumulation
    accelerator = accelerator_for(cfg)            # build_accelerator() with a run's settings
    model, norm = sync_batchnorm(model, accelerator, cfg.sync_bn)  # before prepare()
    optimizer = torch.optim.AdamW(params, fused=fused_kernels(accelerator))
    accelerator.print(describe(accelerator, cfg.batch_size, global_batch=cfg.global_batch_size))
    note = busy_cores_note(accelerator)            # torch's threads on cores that others hold
    ...
    del model, optimizer, train_loader, test_loader   # what holds the process group
    close(accelerator)
"""

import datetime
import functools
import gc
import inspect
import os

import accelerate.optimizer
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, broadcast_object_list

from common.config import UserError
from common.tracking import tracker


def build_accelerator(
    *, gradient_accumulation_steps=1, seed=0, timeout_s=600, log_with="none", **kwargs
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
    _read_zero_grad_signature_once()
    log_with = tracker(log_with)
    world_size = launched_processes()
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
            f"the launcher started {world_size} processes but Accelerate sees "
            f"{accelerator.num_processes}: each would train alone. Check the accelerate config "
            f"(distributed_type, num_processes)"
        )
    return accelerator


def launcher():
    """The launcher that started this process, by what it puts in the environment: "accelerate
    launch" (it sets ACCELERATE_MIXED_PRECISION), "torchrun", or None (python alone)."""
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return "accelerate launch"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else None


def launched_processes():
    """The number of processes the launcher started (1 without one), before any Accelerator."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_main_process(accelerator, compute):
    """compute() done on the main process alone and its result sent to every process: work that
    each would repeat on the same files (listing and pairing a folder's images and masks) is done
    once per job. An error it raises is raised on every process alike, so that no rank waits
    for a result that will not come."""
    if accelerator.num_processes == 1:
        return compute()
    box = [None, None]  # the result, or the error
    if accelerator.is_main_process:
        try:
            box = [compute(), None]
        except Exception as e:  # raised below, on every process
            box = [None, e]
    broadcast_object_list(box)
    result, error = box
    if error is not None:
        raise error
    return result


# The Accelerate release whose optimizer the two workarounds below know (docs/performance.md).
PATCHED_ON = "1.15."


def accelerator_for(cfg):
    """build_accelerator() with a run's settings (a RunConfig): gradient_accumulation_steps (of
    this process count's share of global_batch_size: RunConfig.split_global_batch), seed
    (the data order), dist_timeout_s, log_with, and output_dir for the trackers' files."""
    planned = cfg.split_global_batch(launched_processes())  # global_batch_size: accumulation
    return build_accelerator(
        gradient_accumulation_steps=planned.gradient_accumulation_steps,
        seed=cfg.seed,
        timeout_s=cfg.dist_timeout_s,
        log_with=cfg.log_with,
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


class _SignatureOnce:
    """The `inspect` that accelerate.optimizer sees: signature(), its one use there, answered
    once per function (a bound method's answer is its class's); the rest is inspect's own."""

    def __init__(self):
        self.known = {}

    def signature(self, fn):
        key = getattr(fn, "__func__", fn)
        if key not in self.known:
            self.known[key] = inspect.signature(fn)
        return self.known[key]

    def __getattr__(self, name):
        return getattr(inspect, name)


def _read_zero_grad_signature_once():
    """Accelerate 1.15's optimizer.zero_grad() reads the signature of the wrapped optimizer's
    zero_grad with inspect.signature at every step, to see whether it takes set_to_none (about
    16 us a step on a CPU core; docs/performance.md). An optimizer's method keeps its signature,
    so accelerate.optimizer's `inspect` remembers it. Only on 1.15, as _ask_for_lomo_once."""
    if accelerate.__version__.startswith(PATCHED_ON) and accelerate.optimizer.inspect is inspect:
        accelerate.optimizer.inspect = _SignatureOnce()


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


def elastic_restart():
    """True when torchrun restarted the workers after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def describe(accelerator, batch, global_batch=0):
    """One line: where and how this run trains. batch: the batch size per process, or a text
    that says what a batch is (bucketed batches). global_batch: the global_batch_size setting,
    whose split the line shows; without it, on several processes, the line says that a step
    takes more samples than on one, and the settings that keep this run's global batch, or that
    of one process, on any process count."""
    precision = accelerator.mixed_precision
    if precision == "fp16" and accelerator.device.type == "cpu":
        precision = "fp16 requested, but the CPU runs fp16 configs in fp32 (use bf16 on CPU)"
    backend = f", {accelerator.state.backend}" if accelerator.num_processes > 1 else ""
    dynamo = accelerator.state.dynamo_plugin  # the accelerate config's dynamo_config
    compiled = ""
    if dynamo.backend.value != "NO":
        mode = f" mode {dynamo.mode}" if dynamo.mode not in (None, "default") else ""
        compiled = f", torch.compile backend {dynamo.backend.value.lower()}{mode}"
    processes, steps = accelerator.num_processes, accelerator.gradient_accumulation_steps
    if global_batch:
        batch = (
            f"global batch {global_batch} = {batch} per process x {processes} process(es) x "
            f"{steps} accumulation step(s)"
        )
    elif isinstance(batch, int):
        per_step, one = batch * processes * steps, batch * steps
        batch = f"batch {batch} per process = {per_step} per optimizer step"
        if processes > 1:  # which global batch a user compares with: this run's, or 1 process's
            batch += (
                f" ({processes} times one process's: --global_batch_size {per_step} keeps this "
                f"run's on any process count, --global_batch_size {one} trains as 1 process does)"
            )
    elif processes > 1:
        batch += (
            f" (an optimizer step takes the batches of {processes} processes; "
            f"--global_batch_size keeps the samples of a step on any process count)"
        )
    return (
        f"{accelerator.num_processes} process(es) on {accelerator.device.type}{backend}, "
        f"precision {precision}{compiled}, {batch}"
    )


def busy_cores_note(accelerator):
    """A start-up line when, on the CPU, torch runs more threads than the cores that other work
    leaves free (the cores this process may use, less the load average of the last minute, whole
    cores only): each parallel region then waits for its slowest thread, and one thread can train
    several times faster (docs/performance.md, "Threads on a busy CPU"). None otherwise. The
    thread count stays as the launcher set it: a resume on other threads would round sums in
    another order, and differ from the run it continues."""
    threads, processes = torch.get_num_threads(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores, load = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    free = max(cores - int(load), 1)
    if accelerator.device.type != "cpu" or threads == 1 or threads * processes <= free:
        return None
    each = f" in each of {processes} processes" if processes > 1 else ""
    return (
        f"note: torch runs {threads} threads{each} on {cores} CPU cores with a load average of "
        f"{load:.1f}: on busy cores the threads wait for each other, and one thread per process "
        f"can be several times faster: OMP_NUM_THREADS=1 python ..., or accelerate launch "
        f"--num_cpu_threads_per_process 1 ... (docs/performance.md)"
    )


def fused_kernels(accelerator):
    """`fused=` for a torch optimizer that has a fused kernel (AdamW, Adam, SGD): True on CPUs and
    CUDA GPUs, where one kernel updates all the weights instead of a Python loop over them (on a
    CPU) or a few foreach kernels per step (on a GPU); None, torch's default kernels, under fp16's
    gradient scaler: a fused step always runs, so Accelerate could not tell a skipped one."""
    return (
        True if accelerator.device.type in ("cpu", "cuda") and accelerator.scaler is None else None
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
