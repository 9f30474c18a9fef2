"""Learning-rate schedules that end where the run ends, also across resumes.

One rule for every per-step schedule, at the start of a run and on every resume (fit_schedule):
it ends at the run's last optimizer step. A resume may change that step: other epochs, or, at an
epoch end, another process count, batch size or accumulation. Then a schedule that can be refitted
exactly is refitted, and one that cannot is refused with one line that names the fix.

- CosineAnnealingLR (the U-Net) is refitted. It has one phase, and its lr is a function of the
  step and the last step alone: the refitted schedule gives, from this step on, exactly the lr of
  a run planned with the new length, still falling to 0 at its last step. HeldCosine, the lr held
  for a share of the steps and then the cosine, is refitted the same way (its lr too is a
  function of the step and the last step alone; the held share is of the new plan).
- OneCycleLR (MNIST's onecycle) is refused. Its warm-up is the first 30% of the planned steps: on
  a longer plan a run past its peak could be back in the warm-up, its lr rising a second time on
  weights that are trained already. That is a new run, not the rest of this one (torch itself
  stops a OneCycleLR stepped past its length).
- Per-epoch schedules (StepLR, ReduceLROnPlateau) count epochs, not steps: nothing to fit.

A checkpoint resumes only with the kind of schedule it was written with (same_kind).
"""

import math

from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR

from common.config import UserError

FIX = "resume with the scheduler, epochs, batch size and process count it was written with"


def fit_schedule(scheduler, cfg, progress, *, batches_per_epoch, checkpoint=None):
    """Apply the rule above to `scheduler`, at the start of a run or after the resume from
    `checkpoint`. progress: where the run is (epoch, batches_done, step), a Progress.
    batches_per_epoch: this process's batches in a whole epoch. eval_only steps no schedule."""
    if cfg.eval_only:
        return
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    if isinstance(scheduler, CosineAnnealingLR):
        fit_cosine(scheduler, cfg, progress, steps_per_epoch=steps_per_epoch)
    elif isinstance(scheduler, OneCycleLR):
        end = progress.step + _steps_left(cfg, progress, steps_per_epoch)
        if scheduler.total_steps != end:
            raise UserError(
                f"checkpoint {checkpoint} has {_kind(scheduler.state_dict())}, this run "
                f"plans a onecycle schedule of {end} steps: {FIX}"
            )


def _steps_left(cfg, progress, steps_per_epoch):
    """Optimizer steps from here to the end of the last epoch: the rest of this epoch, then the
    later ones. max_steps does not count: it only stops a run, which a resume continues."""
    epochs, _ = cfg.limits()
    done = math.ceil(progress.batches_done / cfg.gradient_accumulation_steps)
    return (epochs - progress.epoch + 1) * steps_per_epoch - done


class HeldCosine(CosineAnnealingLR):
    """The lr held at its base for the first `hold` share of the T_max steps, then a cosine from
    there to 0 at step T_max: a cosine that starts late. `hold` 0 is CosineAnnealingLR."""

    def __init__(self, optimizer, hold, T_max=1):
        if not 0 <= hold < 1:
            raise ValueError(f"hold must be in [0, 1), got {hold}")
        self.hold = hold  # before super(), which takes the first step
        super().__init__(optimizer, T_max=T_max)

    def get_lr(self):
        return [cosine_lr(base, self.last_epoch, self.T_max, self.hold) for base in self.base_lrs]


def cosine_lr(base_lr, step, last, hold=0.0):
    """The lr at `step` of a cosine from base_lr at step hold x last to 0 at step `last`, held at
    base_lr before it."""
    start = hold * last
    if step <= start:
        return base_lr
    return base_lr * (1 + math.cos(math.pi * min(1.0, (step - start) / (last - start)))) / 2


def fit_cosine(scheduler, cfg, progress, *, steps_per_epoch):
    """Make a CosineAnnealingLR or a HeldCosine reach 0 at the last optimizer step of the run.

    max_steps does not shorten it: it only stops the run, which a resume continues on the same
    curve. A resume may change epochs, or the process count at an epoch end; the lr then moves
    onto the new curve at the current step. progress: where the run is (epoch, batches_done,
    step), a common.progress.Progress. steps_per_epoch: this process's optimizer steps per epoch.
    """
    steps_left = _steps_left(cfg, progress, steps_per_epoch)
    end = progress.step + steps_left
    # end_step is saved with the schedule's state: a resume with the same plan leaves it as it is.
    if steps_left > 0 and end != getattr(scheduler, "end_step", None):
        scheduler.end_step = end
        # The schedule counts the steps it was stepped on, not the fp16 steps the scaler skipped.
        if scheduler.last_epoch + steps_left != scheduler.T_max:
            scheduler.T_max = scheduler.last_epoch + steps_left
            hold = getattr(scheduler, "hold", 0.0)
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = cosine_lr(base_lr, scheduler.last_epoch, scheduler.T_max, hold)


def _kind(state):
    """What a scheduler's state_dict says it is, in a few words."""
    if "total_steps" in state:
        return f"a onecycle schedule of {state['total_steps']} steps"
    kinds = {
        "hold": "a held cosine schedule",
        "T_max": "a cosine schedule",
        "step_size": "a step schedule",
        "patience": "a plateau schedule",
        "factor": "a constant schedule",
    }
    return next((name for key, name in kinds.items() if key in state), "another schedule")


def same_kind(scheduler, saved, checkpoint):
    """`saved`, a checkpoint's scheduler state, if it is of `scheduler`'s kind, else a UserError:
    loaded into a schedule of another kind, it would garble it."""
    had, plans = _kind(saved), _kind(scheduler.state_dict())
    if had.split(" of ")[0] != plans.split(" of ")[0]:
        raise UserError(f"checkpoint {checkpoint} has {had}, this run plans {plans}: {FIX}")
    return saved
