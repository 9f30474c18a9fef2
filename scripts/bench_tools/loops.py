"""The loops a variant runs, one repetition each: the recipe's own epoch, the bound, the classic
tutorial loop. Each returns rep(), which trains one repetition and returns its sample count."""

import torch
import torch.nn.functional as F


def last_batches(train_loader, steps, dataset, *, at_most=False):
    """The epoch's length in batches, and the sizes of its last `steps` batches (0: all of them;
    at_most: up to `steps`, as --quick asks, else more than an epoch stops with an error).

    The recipe and the bound train on batches of these sizes: the recipe reaches them through
    skip_first_batches, its own mid-epoch resume path."""
    epoch_steps = len(train_loader)
    steps = min(steps, epoch_steps) if at_most else steps or epoch_steps
    if steps > epoch_steps:
        raise SystemExit(
            f"error: --steps {steps} is more than one epoch ({epoch_steps} steps) of {dataset}"
        )
    samples, batch_size = len(train_loader.dataset), train_loader.batch_size
    sizes = [batch_size] * epoch_steps
    sizes[-1] = samples - batch_size * (epoch_steps - 1)
    return epoch_steps, sizes[epoch_steps - steps :]


def recipe_rep(accelerator, loader, progress, epoch_steps, sizes, train_epoch):
    """A repetition of the recipe, run as the recipe's main() runs an epoch: set_epoch (and the
    U-Net's augmentation epoch), then the last len(sizes) batches of the epoch, reached as a
    mid-epoch resume reaches them (progress.load() of the position, skip_first_batches), trained
    by train_epoch(loader), and progress.end_epoch(). progress: the recipe's
    common.progress.Progress, which train_one_epoch updates; the bench only reads it."""
    skip = epoch_steps - len(sizes)

    def rep():
        loader.set_epoch(progress.epoch)  # a new order every epoch
        if hasattr(loader.dataset, "epoch"):
            loader.dataset.epoch = progress.epoch  # and new augmentations
        if skip:  # where a checkpoint taken `skip` batches into this epoch resumes
            progress.load({**progress.state(), "batches_done": skip})
        train = train_epoch(accelerator.skip_first_batches(loader, skip) if skip else loader)
        if progress.interrupted:  # Ctrl-C: train_one_epoch stopped (and checkpointed to scratch)
            raise KeyboardInterrupt
        if not progress.end_epoch(epoch_steps):
            raise RuntimeError(
                f"the epoch ended after {progress.batches_done} of {epoch_steps} batches"
            )
        rep.peak_mb = train["peak_memory_mb"]
        return sum(sizes)

    return rep


def bound_step(accelerator, model, optimizer, x, y):
    """A classifier's training step with nothing around it: model, loss, backward, optimizer."""
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def bound_rep(model, batches, train_step):
    """A repetition of the bound: train_step(x, y) on each of `batches`, already on the device."""

    def rep():
        model.train()
        for x, y in batches:
            train_step(x, y)
        return sum(len(y) for _, y in batches)

    return rep


def classic_rep(model, loader, steps, device, train_step):
    """A repetition of a tutorial loop: the first `steps` batches of `loader`, each sent to the
    device per batch as the tutorials do (images float32, targets int64), then train_step(x, y)."""

    def rep():
        model.train()
        samples = 0
        for i, (x, y) in enumerate(loader):
            if i == steps:
                break
            train_step(x.to(device, torch.float32), y.to(device, torch.long))
            samples += len(y)
        return samples

    return rep
