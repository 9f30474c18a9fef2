"""Ctrl-C and SIGTERM during training: stop at the next check, with a checkpoint, on every rank.

    catch_stop_signals()                      # in main, as the training loop starts
    ...
    if stop_requested(accelerator, step):     # every optimizer step, on every rank
        ...write a checkpoint, leave the loop...

    DataLoader(..., worker_init_fn=ignore_stop_signals)

Nothing happens on import: until catch_stop_signals() the signals act as usual (start-up, data
loading and evaluate-only runs stop at once). Under torchrun or accelerate launch, Ctrl-C reaches
every worker and the launcher, which then sends SIGTERM as well: that one only confirms the stop.
"""

import os
import signal

import torch


def ignore_stop_signals(worker_id=None):
    """A DataLoader worker_init_fn. A terminal's Ctrl-C reaches every process of the foreground
    group, and torchrun stops a rank by signalling its whole process group: DataLoader workers
    would get the signal too and die, ending the run before its checkpoint. So a worker leaves
    the group: stop signals go to the training process, which polls for them (stop_requested),
    checkpoints and then stops its workers itself. A worker still exits when its parent does."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _StopRequest:
    """Once installed, Ctrl-C or SIGTERM sets a flag instead of killing the process mid-step;
    a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self.installed = False
        self.interrupted = False

    def install(self):
        if not self.installed:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handle)
            self.installed = True

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
        self.requested = True


_stop = _StopRequest()


def catch_stop_signals():
    """From now on Ctrl-C and SIGTERM set the flag that stop_requested() reads. Call it before
    the DataLoader workers start: a forked worker keeps the handler it was born with."""
    _stop.install()


def stop_was_requested():
    """True if this process got Ctrl-C or SIGTERM after catch_stop_signals(): its exit status."""
    return _stop.requested


def stop_requested(accelerator, step, every=10):
    """True on every rank once any rank got Ctrl-C or SIGTERM, checked every `every` steps.

    Call it on all ranks after every optimizer step (it is a collective on those steps);
    when it says True, save a checkpoint and leave the loop."""
    if step % every:
        return False
    flag = torch.tensor(float(_stop.requested), device=accelerator.device)
    return accelerator.reduce(flag, "max").item() > 0
