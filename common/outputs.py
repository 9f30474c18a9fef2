"""The output folder of a run: created, locked against a second run into it, and removed again
if the run fails before it trains.

    out, checkpoint = open_run(accelerator, cfg)   # output_dir, and the checkpoint to resume from
    training_started(cfg.output_dir)               # Progress.start_epoch: from here it stays
    leave_output_dir(failed)                       # run(), as the process ends
    with stop_together(accelerator): ...           # one process's UserError stops them all
    write_csv(accelerator, rows, path, header=[...])  # every process's rows, written once
"""

import contextlib
import csv
import errno
import fcntl
import os
import shutil
import socket
import sys
from pathlib import Path

from accelerate.utils import gather_object

from common.accelerator import elastic_restart
from common.checkpoint import choose_checkpoint
from common.config import UserError

# Only this module changes these two lists.
_locks = []  # the open lock files of lock_output_dir
_created = []  # output folders that open_run created and locked: leave_output_dir may remove them

# In a folder that open_run created, until training starts: a user error before then removes it.
UNTRAINED = ".untrained"


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
        cfg.resume, out / "checkpoints", eval_only=cfg.eval_only, restarted=elastic_restart()
    )
    if cfg.resume == "latest" and not checkpoint:
        accelerator.print(
            f"resume latest: no checkpoint in {out / 'checkpoints'} yet, so training starts at "
            f"step 0"
        )
    return out, checkpoint


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
                    f"warning: cannot lock {out} ({e.strerror}): nothing stops a second run "
                    f"into it",
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


def raise_if_any(accelerator, problem):
    """A collective: every rank passes its own problem (a message, or None); if any rank has
    one, every rank raises UserError with the first, so none waits for a rank that stopped."""
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        raise UserError(problems[0])


def _not_writable(path, error):
    return UserError(
        f"output_dir {path} is not writable ({error.strerror}): choose another --output_dir"
    )


@contextlib.contextmanager
def stop_together(accelerator):
    """Around work that each process does on its own share (files to predict): a UserError in the
    block, on any process, is raised on every process as it leaves the block, so rank 0 says it
    and none waits in a later collective for a process that stopped. A collective: every process
    runs the block."""
    problem = None
    try:
        yield
    except UserError as e:
        problem = str(e)
    raise_if_any(accelerator, problem)


def write_csv(accelerator, rows, path, *, header):
    """Write every process's `rows` (lists of values) under `header` to the CSV file `path`, its
    folder made if need be. A collective: the rows are gathered in process order (the order of
    split_between_processes' shares), then the main process writes them atomically, a temporary
    file then os.replace, so a reader sees the old file or the whole new one. A file that cannot
    be written stops every process with one line. Returns how many rows were written."""
    rows = gather_object(rows)  # the processes' lists, one after the other
    path, problem = Path(path), None
    if accelerator.is_main_process:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(header)
                writer.writerows(rows)
            os.replace(tmp, path)
        except OSError as e:
            problem = f"cannot write {path} ({e.strerror or e}): choose another path"
            if tmp.exists():
                tmp.unlink()
    raise_if_any(accelerator, problem)
    return len(rows)
