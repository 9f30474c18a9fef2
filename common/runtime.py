"""Starting and stopping a run: the Accelerator, user errors, and a clean exit.

    def main(cfg):
        accelerator = build_accelerator(cfg.gradient_accumulation_steps, cfg.seed)
        ...training...
        del model, optimizer, train_loader, test_loader
        close(accelerator)

    if __name__ == "__main__":
        run(main, Config)
"""

import datetime
import gc
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

from common.config import UserError, parse_config


def build_accelerator(gradient_accumulation_steps=1, seed=0, timeout_s=600, **kwargs):
    """An Accelerator whose process count is what the launcher asked for.

    Machine settings (processes, precision, machines) come from the accelerate config,
    never from here. Two things are decided here:
    - on a machine with no GPU, a multi-process launch runs real DDP over gloo on the CPU.
      Without this, Accelerate quietly starts N independent single-process trainings.
    - the data order is a function of (seed, epoch) only (`use_seedable_sampler`), so it is
      the same on every rank, changes every epoch, and can be replayed on resume.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_ddp = world_size > 1 and not torch.cuda.is_available()
    accelerator = Accelerator(
        cpu=cpu_ddp,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        # A rank that dies mid-collective brings the others down after this long, not never.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
        **kwargs,
    )
    if accelerator.num_processes != world_size:
        raise UserError(
            f"the launcher started {world_size} processes but Accelerate sees {accelerator.num_processes}: "
            f"each would train alone. Check the accelerate config (distributed_type, num_processes)"
        )
    return accelerator


def describe(accelerator, batch_size):
    """One line: where and how this run trains."""
    precision = accelerator.mixed_precision
    if precision == "fp16" and accelerator.device.type == "cpu":
        precision = "fp16 requested, but the CPU runs fp16 configs in fp32 (use bf16 on CPU)"
    backend = f", {accelerator.state.backend}" if accelerator.num_processes > 1 else ""
    return (
        f"{accelerator.num_processes} process(es) on {accelerator.device.type}{backend}, "
        f"precision {precision}, batch {batch_size} per process = "
        f"{batch_size * accelerator.num_processes * accelerator.gradient_accumulation_steps} per optimizer step"
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


def _rank():
    return int(os.environ.get("RANK", "0"))


def run(main, config_class, argv=None):
    """Parse the config, call main(cfg), and turn user errors into one line and exit status 2.

    A UserError (bad config, bad data) is expected on every rank, so only rank 0 prints it.
    `--debug` shows the full traceback instead. Other exceptions keep their traceback.
    """
    debug = "--debug" in (sys.argv if argv is None else argv)
    try:
        main(parse_config(config_class, argv))
    except UserError as e:
        if debug:
            raise
        if _rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    else:
        code = 0
    finally:
        # On the error path the traceback keeps main's locals (the DDP model) alive: drop them
        # before the process group goes, for the same reason as in close().
        sys.last_traceback = None
        gc.collect()
        if PartialState._shared_state and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.exit(code)
