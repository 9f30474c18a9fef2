"""Where a run is, and the bookkeeping around its training step. It never runs the loop.

    run = Progress(accelerator, cfg, metric="accuracy")
    if checkpoint:
        run.load(trainer_state)                        # epoch, batch in the epoch, step, best
    while run.epochs_left():
        loader = run.rest_of_epoch(train_loader)      # set_epoch; a resumed epoch skips its start
        run.start_epoch(len(loader))
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = ...
                accelerator.backward(run.weighted(loss))
                optimizer.step()
                optimizer.zero_grad()
            if not run.after_batch(loss, len(y)):      # still accumulating
                continue
            if run.log_due:
                accelerator.log(run.train_scalars(optimizer), step=run.step)
            if run.checkpoint_due:                     # every checkpoint_every_steps, and on a stop
                save_checkpoint(..., trainer_state={**run.state(), ...})
            if run.stopping:                           # max_steps, or Ctrl-C / SIGTERM
                break
        train_metrics = run.epoch_metrics()
        ...evaluate...
        if run.end_epoch(len(train_loader)):           # the epoch was complete
            ...epoch-end checkpoint...

after_batch() on some steps, state() mid-epoch, train_scalars() and epoch_metrics() are
collectives: call them on every rank, in the same order, as the loop above does. Between those
steps after_batch() does no host sync: the loss is added up on the device.
"""

from pathlib import Path

import torch
from accelerate.utils import broadcast

from common.accelerator import launcher
from common.metrics import Throughput, TrainLoss, peak_memory_mb, reset_peak_memory
from common.outputs import training_started
from common.signals import stop_requested

CHECK_EVERY = 10  # optimizer steps between looks for a nan loss and for Ctrl-C on any rank


class Progress:
    """Epoch, batches done in it, optimizer steps, the best metric and the evaluations since,
    and per epoch the training loss, throughput, skipped fp16 steps and the short last
    accumulation group. metric: the name of the evaluation result that `best` and early
    stopping (cfg.early_stop_patience) follow, higher is better."""

    def __init__(self, accelerator, cfg, metric):
        self.accelerator, self.cfg, self.metric = accelerator, cfg, metric
        self.epochs, self.max_steps = cfg.limits()
        self.best_key = f"best_{metric}"
        self.epoch, self.batches_done, self.step, self.best = 1, 0, 0, None
        self.evals_since_best = 0
        self.stopping = self.interrupted = self.log_due = self.checkpoint_due = False
        self.checkpoints = Path(cfg.output_dir) / "checkpoints"
        self.carried = (0.0, 0, 0)  # loss sum, samples and skipped steps of a resumed epoch's start

    def state(self):
        """What a checkpoint stores to continue from here (trainer_state.json). Mid-epoch, also the
        epoch's loss sum and sample count over all ranks (a collective), so that a resumed epoch
        reports the training loss of all its batches, as an uninterrupted one does; and the
        samples of the epoch done over all ranks, where a global batch resumes on any count."""
        carried = [0.0, 0, 0]
        if self.batches_done:
            loss_sum, samples = self.losses.totals(self.accelerator)
            carried = [loss_sum, int(samples), self.skipped]
        per_batch = self.cfg.batch_size * self.accelerator.num_processes  # over all ranks
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "samples_done": self.batches_done * per_batch,
            "step": self.step,
            self.best_key: self.best,
            "evals_since_best": self.evals_since_best,
            "epoch_so_far": carried,
        }

    def load(self, state):
        self.epoch, self.batches_done, self.step = (
            state["epoch"],
            state["batches_done"],
            state["step"],
        )
        if self.batches_done and self.cfg.global_batch_size:
            # Whole global batches: the same place in the epoch on any process count and split.
            per_batch = self.cfg.batch_size * self.accelerator.num_processes
            self.batches_done = state["samples_done"] // per_batch
        self.best = state.get(self.best_key)
        self.evals_since_best = state.get("evals_since_best", 0)
        if self.batches_done:
            self.carried = tuple(state.get("epoch_so_far", (0.0, 0, 0)))

    def epochs_left(self):
        """True while there is training to do: not eval_only, neither limit reached, no stop,
        patience left."""
        return (
            not self.cfg.eval_only
            and self.epoch <= self.epochs
            and self.step < self.max_steps
            and not self.interrupted
            and not self.out_of_patience
        )

    def rest_of_epoch(self, loader):
        """The training `loader` in this epoch's order (set_epoch: new every epoch, the same on
        every rank), less the batches that a run resumed mid-epoch has trained on already."""
        loader.set_epoch(self.epoch)
        if self.batches_done:
            return self.accelerator.skip_first_batches(loader, self.batches_done)
        return loader

    def start_epoch(self, batches):
        """Reset the epoch's meters. batches: what the loader yields (the rest, after a resume)."""
        training_started(self.cfg.output_dir)
        reset_peak_memory(self.accelerator.device)  # peak_memory_mb: this epoch's training
        self.losses = TrainLoss(self.accelerator.device, self.step)
        self.speed, self.window = Throughput(), Throughput()
        loss_sum, samples, self.skipped = self.carried  # a resumed epoch's batches before the stop
        self.losses.carry(loss_sum, samples, self.accelerator.is_main_process)
        self.carried = (0.0, 0, 0)
        # Accelerate divides every loss by gradient_accumulation_steps. When that does not divide
        # the epoch's batches, the last group is shorter: its losses weigh more, so that its step
        # too gets the mean gradient of its batches.
        total, group = self.batches_done + batches, self.cfg.gradient_accumulation_steps
        self.short_from = total - total % group
        self.short_weight = group / (total % group) if total % group else 1.0

    def weighted(self, loss):
        """The loss to backpropagate: weighted up inside a short last accumulation group."""
        return loss * self.short_weight if self.batches_done >= self.short_from else loss

    def after_batch(self, loss, samples):
        """Count a batch; True when it ended an optimizer step. Then step is one more, and
        log_due, checkpoint_due and stopping say what the loop does next. A nan or inf loss
        on any rank raises before a checkpoint can hold it."""
        self.batches_done += 1
        self.losses.update(loss, samples)  # one kernel, no host sync
        self.speed.update(samples)
        self.window.update(samples)
        self.log_due = self.checkpoint_due = False
        if not self.accelerator.sync_gradients:
            return False
        self.step += 1
        self.skipped += self.accelerator.optimizer_step_was_skipped  # fp16: the scaler skipped it
        at_limit = self.step >= self.max_steps  # then look now: a Ctrl-C must not pass for the end
        self.interrupted = stop_requested(
            self.accelerator, 0 if at_limit else self.step, CHECK_EVERY
        )
        self.stopping = self.interrupted or at_limit
        every = self.cfg.checkpoint_every_steps
        self.checkpoint_due = self.stopping or bool(every and self.step % every == 0)
        if self.checkpoint_due or self.step % CHECK_EVERY == 0:
            self.losses.check(self.accelerator, self.step, self.checkpoints)
        self.log_due = self.cfg.log_with != "none" and self.step % self.cfg.log_every == 0
        return True

    def train_scalars(self, optimizer):
        """The training scalars for the tracker since the last call: the loss over all ranks,
        lr and samples/s."""
        scalars = {
            "train/loss": self.losses.window(self.accelerator),
            "train/lr": optimizer.param_groups[0]["lr"],
            "train/samples_per_s": self.window.compute(self.accelerator),
        }
        self.window = Throughput()
        return scalars

    def epoch_metrics(self):
        """The epoch's training metrics for metrics.jsonl, after a last check for a nan loss."""
        self.losses.check(self.accelerator, self.step, self.checkpoints)
        return {
            "train_loss": self.losses.mean(self.accelerator),
            "train_samples_per_s": self.speed.compute(self.accelerator),
            "skipped_steps": self.skipped,
            "peak_memory_mb": peak_memory_mb(self.accelerator.device),
        }

    def end_epoch(self, batches):
        """True if the epoch of `batches` batches is complete (max_steps can stop one early):
        the position moves to the start of the next epoch."""
        if self.batches_done != batches:
            return False
        self.epoch, self.batches_done = self.epoch + 1, 0
        return True

    def improved(self, result):
        """True, and remembered, if result[metric] is the best so far (higher is better); else one
        more evaluation without improvement. Every rank takes rank 0's value (a collective), so
        all decide alike whether to write best weights and whether to stop early."""
        value = torch.tensor(
            [result[self.metric]], dtype=torch.float64, device=self.accelerator.device
        )
        value = broadcast(value).item()
        if self.best is not None and value <= self.best:
            self.evals_since_best += 1
            return False
        self.best, self.evals_since_best = value, 0
        return True

    @property
    def why_stopped(self):
        """The line that ends a run stopped before its last epoch: by Ctrl-C or SIGTERM (and how
        to go on), or by early stopping; None otherwise."""
        if self.interrupted:
            line = f"stopped at step {self.step}; continue with --resume latest"
            if name := launcher():  # it reports the stop after this line, as a failure
                line += f" ({name}'s traceback below reports this stop: nothing else went wrong)"
            return line
        if self.out_of_patience:
            return (
                f"stopped early: no better {self.metric} in {self.cfg.early_stop_patience} "
                f"evaluations"
            )
        return None

    @property
    def out_of_patience(self):
        """early_stop_patience evaluations in a row without a better metric."""
        patience = self.cfg.early_stop_patience
        return bool(patience) and self.evals_since_best >= patience
