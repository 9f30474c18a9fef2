"""The process entry of a recipe: parse the config, call main(cfg), and turn user errors into
one line and a clean exit.

    def main(cfg):
        accelerator = accelerator_for(cfg)                  # common/accelerator.py
        out, checkpoint = open_run(accelerator, cfg)        # common/outputs.py
        ...data...
        metrics = start_logging(accelerator, cfg, "mnist", checkpoint=checkpoint)  # tracking.py
        ...training...
        del model, optimizer, train_loader, test_loader
        close(accelerator)

    if __name__ == "__main__":
        run(main, Config)
"""

import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState

from common.config import ShowHelp, UserError, parse_config
from common.outputs import leave_output_dir
from common.signals import stop_was_requested


def _rank():
    return int(os.environ.get("RANK", "0"))


def _stop_loader_workers():
    """Stop the DataLoader workers of every live loader iterator now, while each is whole.

    After an error the iterators sit in a reference cycle with the traceback. gc.collect()
    would clear their queues before their __del__ runs, so the stop message never reaches a
    worker, and torch waits out its timeout for each one: the process would linger after its
    error line (docs/performance.md)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    for obj in gc.get_objects():
        if type(obj) is _MultiProcessingDataLoaderIter:  # isinstance() would wake lazy modules
            obj._shutdown_workers()


SERVES = ("--predict", "--export", "--check_data")  # a command line with one is the serving file's


def run(main, config_class, argv=None, positional=None, *, serving=None):
    """Parse the config, call main(cfg), and turn user errors into one line and exit status 2.
    positional: the setting that an argument without a --name gives (parse_config). serving: the
    recipe's serving file, which runs in this process's place (hand_over) when the command line
    asks to predict, export or check the data: the settings of those (predict_dir, top_k, ...)
    are the serving file's, which the training file's Config does not know.

    Once the recipe calls common.signals.catch_stop_signals(), Ctrl-C and SIGTERM only set a flag
    that the training loop polls, so it can write a checkpoint and exit cleanly on every rank
    (status 130).

    A UserError (bad config, bad data) usually happens on every rank, so rank 0 prints it and
    the others wait a moment for the launcher to stop them.
    `--debug` shows the full traceback instead. Other exceptions keep their traceback.
    """
    if serving and argv is None and any(a.split("=", 1)[0] in SERVES for a in sys.argv[1:]):
        hand_over(serving)
    debug = "--debug" in (sys.argv if argv is None else argv)
    # What the imports made (torch, accelerate: several hundred thousand objects) lives until the
    # process ends. Out of the collector's sight, it leaves the full collections in close()
    # (common/accelerator.py) and below, which drop the DDP model before the process group,
    # short (docs/performance.md).
    gc.freeze()
    failed = False
    try:
        main(parse_config(config_class, argv, positional))
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
        # the interpreter's own collections at exit would walk it all (docs/performance.md).
        gc.freeze()
    sys.exit(code)


def hand_over(script):
    """Run `script` (a recipe's serving file) in this process's place, with this process's
    arguments and environment: `python recipes/unet.py --predict ...` is `python
    recipes/unet_predict.py --predict ...`, under any launcher, without the training file
    importing its serving file (which imports it). Called before any process group exists."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, str(script), *sys.argv[1:]])


def run_serving(serve, config_class, *, recipe, script):
    """A serving file's entry point (`python recipes/unet_predict.py --weights W "*.jpg"`): run(),
    with the glob of files as the one argument without a --name (the predict setting), into its
    serve(cfg), which predicts, exports or checks the data. A run that would train stops with one
    line naming the recipe."""

    def serving(cfg):
        if not (cfg.predict or cfg.export or cfg.check_data):
            raise UserError(
                f"{Path(script).name} predicts (a glob of files), exports (--export onnx) or "
                f"checks the data (--check_data); train with {recipe}.py"
            )
        serve(cfg)

    run(serving, config_class, positional="predict")
