"""Learning-rate schedules that end where the run ends, also across resumes."""

import math

from common.config import UserError


def fit_cosine(scheduler, cfg, progress, steps_per_epoch):
    """Make a CosineAnnealingLR reach 0 at the last optimizer step of the last epoch.

    max_steps does not shorten it: it only stops the run, which a resume continues on the same
    curve. A resume may change epochs, or the process count at an epoch end; the lr then moves
    onto the new curve at the current step. progress: where the run is (epoch, batches_done,
    step), a common.progress.Progress. steps_per_epoch: this process's optimizer steps per epoch.
    """
    epochs, _ = cfg.limits()
    steps_left = (epochs - progress.epoch + 1) * steps_per_epoch - math.ceil(
        progress.batches_done / cfg.gradient_accumulation_steps)  # the rest of this epoch, then the later ones
    end = progress.step + steps_left
    # end_step is saved with the schedule's state: a resume with the same plan leaves it as it is.
    if steps_left > 0 and end != getattr(scheduler, "end_step", None):
        scheduler.end_step = end
        # The schedule counts the steps it was stepped on: fp16 steps that the scaler skipped are not among them.
        if scheduler.last_epoch + steps_left != scheduler.T_max:
            scheduler.T_max = scheduler.last_epoch + steps_left
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base_lr * (1 + math.cos(math.pi * scheduler.last_epoch / scheduler.T_max)) / 2


def same_schedule(scheduler, saved, checkpoint):
    """`saved`, a checkpoint's scheduler state, if `scheduler` can go on from it, else a UserError.
    A OneCycleLR fixes its length (total_steps) when it is made: resuming one needs a schedule of
    the same kind and length, the same epochs x optimizer steps per epoch."""
    planned, length = getattr(scheduler, "total_steps", None), saved.get("total_steps")
    if planned != length:
        had, plans = (f"a onecycle schedule of {n} steps" if n else "no onecycle schedule"
                      for n in (length, planned))
        raise UserError(f"checkpoint {checkpoint} has {had}, this run plans {plans}: resume with the "
                        f"scheduler, epochs, batch size and process count it was written with")
    return saved
