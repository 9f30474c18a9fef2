"""Hyperparameter sweeps on Optuna: every trial is a real launch of a recipe.

    python scripts/sweep.py --study mnist-lr --trials 8 \\
        --param lr=loguniform:0.05:3 --param batch_size=choice:32,64,128 \\
        -- recipes/mnist.py --dataset data/mnist_sample --epochs 3
    python scripts/sweep.py ... --config_file accelerate_configs/2gpu.yaml   # trials on 2 GPUs

What follows `--` is what follows `accelerate launch --config_file FILE` for one run: the recipe
and its fixed settings. Each trial adds `--output_dir OUT/trial-NNNN` and its drawn settings, and
runs under the accelerate config given (CPU, one GPU, several GPUs). docs/sweeps.md has more.

- Search space: `--param NAME=loguniform:LOW:HIGH`, `uniform:LOW:HIGH`, `int:LOW:HIGH` or
  `choice:A,B,C`, one per setting.
- Metric: `--metric` (a key of the trial's metrics.jsonl, such as accuracy or miou) and
  `--direction`. Each epoch's value is reported to the pruner; a trial's value is its best epoch
  (the weights best.safetensors keeps).
- Pruning (`--pruner median` or `halving`): a losing trial gets SIGTERM, so it stops at a
  checkpoint, as Ctrl-C stops a run, and is marked pruned.
- The study lives in Optuna's storage: OUT/study.db (SQLite) by default; `--storage` takes a
  journal file (`*.journal`, for a shared filesystem) or a database URL, so that several sweep
  processes, on one machine or many, work on one study. Each takes the next trial; none runs a
  trial another is running.
- Ctrl-C or SIGTERM stops the running trial at a checkpoint and then the sweep. The same command
  again continues the study, and the cut-off trial continues from its checkpoint
  (`--resume latest`), whichever sweep process picks it up.
- At the end: a table of the trials and the best trial's command.
"""

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

KINDS = ("loguniform", "uniform", "int", "choice")
PRUNERS = ("median", "halving", "none")
INSTALL = "pip install -r requirements-extras.txt"


class SweepError(Exception):
    """Bad input or a sweep that cannot go on: one line, exit status 2."""


def parse_param(text):
    """`NAME=KIND:ARGS` -> (name, kind, bounds or choices)."""
    name, sep, spec = text.partition("=")
    kind, _, rest = spec.partition(":")
    usage = (
        f"--param {text!r}: write NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH or "
        f"choice:A,B,C"
    )
    if not sep or not name.isidentifier() or kind not in KINDS or not rest:
        raise SweepError(usage)
    if kind == "choice":
        return name, kind, rest.split(",")
    try:
        bounds = [(int if kind == "int" else float)(v) for v in rest.split(":")]
    except ValueError:
        raise SweepError(usage) from None
    if len(bounds) != 2 or not bounds[0] < bounds[1] or (kind == "loguniform" and bounds[0] <= 0):
        raise SweepError(f"{usage}; LOW must be below HIGH (and above 0 for loguniform)")
    return name, kind, bounds


def suggest(trial, space):
    """The trial's settings, drawn by the study's sampler: {name: value}."""
    params = {}
    for name, kind, args in space:
        if kind == "choice":
            params[name] = trial.suggest_categorical(name, args)
        elif kind == "int":
            params[name] = trial.suggest_int(name, *args)
        else:
            params[name] = trial.suggest_float(name, *args, log=kind == "loguniform")
    return params


def trial_command(args, output_dir, params):
    """The trial's launch, as a user would type it."""
    accelerate = Path(sys.executable).with_name("accelerate")  # this environment's
    if not accelerate.exists() or shutil.which("accelerate") == str(accelerate):
        accelerate = "accelerate"  # found as it is typed
    settings = [str(a) for name, value in params.items() for a in (f"--{name}", value)]
    return [
        str(accelerate),
        "launch",
        "--config_file",
        args.config_file,
        *args.recipe,
        "--output_dir",
        str(output_dir),
        *settings,
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lock(path, wait=True):
    """An open file holding a POSIX lock on `path` (created if missing), or None if another
    process holds it and `wait` is False. The system drops the lock when the process ends, also
    after a kill, so a held lock means a live holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def epoch_values(path, metric):
    """{epoch: value} of `metric` in a trial's metrics.jsonl, and the keys its lines hold."""
    values, keys = {}, set()
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line still being written
                record = json.loads(line)
                keys.update(record)
                if isinstance(record.get("epoch"), int) and record.get(metric) is not None:
                    values[record["epoch"]] = record[metric]
    return values, keys


class Stop:
    """Ctrl-C or SIGTERM: passed on to the running trial, which stops at a checkpoint; the sweep
    then ends and leaves that trial to be continued."""

    def __init__(self):
        self.signal, self.trial = None, None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.signal = signum
        if self.trial is not None and self.trial.poll() is None:
            os.killpg(self.trial.pid, signum)


class Sweep:
    def __init__(self, args, optuna):
        self.args, self.optuna = args, optuna
        self.out = Path(args.out or f"runs/sweeps/{args.study}")
        self.space = [parse_param(p) for p in args.param]
        # This process's name in the study; its lock file, held while it lives, tells the others
        # whether the trials it runs still have a sweep behind them.
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.alive = lock(self.out / ".sweepers" / self.name)
        self.study = self.open_study()
        self.stop = Stop()
        self.failures = 0

    def open_study(self):
        optuna = self.optuna
        from optuna.storages.journal import JournalFileBackend, JournalStorage
        from sqlalchemy.exc import SQLAlchemyError

        spec = self.args.storage or str(self.out / "study.db")
        pruner = {
            "median": optuna.pruners.MedianPruner(
                n_startup_trials=self.args.prune_after, n_warmup_steps=self.args.prune_warmup
            ),
            "halving": optuna.pruners.SuccessiveHalvingPruner(),
            "none": optuna.pruners.NopPruner(),
        }[self.args.pruner]
        try:
            if "://" in spec:  # a database URL
                storage = spec
            elif spec.endswith((".db", ".sqlite", ".sqlite3")):
                storage = f"sqlite:///{Path(spec).resolve()}"
            else:  # a journal file
                storage = JournalStorage(JournalFileBackend(spec))
            study = optuna.create_study(
                storage=storage,
                study_name=self.args.study,
                direction=self.args.direction,
                sampler=optuna.samplers.TPESampler(seed=self.args.seed),
                pruner=pruner,
                load_if_exists=True,
            )
        except (ImportError, OSError, SQLAlchemyError) as e:  # no driver, no folder, no server
            why = str(e).strip().splitlines()[0][:200]
            raise SweepError(
                f"cannot open the study's storage {spec} ({why}): check --storage; a database "
                f"URL needs its driver (postgresql: pip install psycopg2-binary)"
            ) from None
        if study.direction.name.lower() != self.args.direction:
            raise SweepError(
                f"study {self.args.study} is to {study.direction.name.lower()} its metric: pass "
                f"--direction {study.direction.name.lower()}, or name a new --study"
            )
        return study

    def next_trial(self):
        """(trial, settings, epochs reported before or None) of the next trial for this process,
        or None when the study has its --trials: first a trial whose sweep process died (it
        continues from its checkpoint), else a new one. One process at a time decides (a lock in
        the sweep's folder), so two never take the same trial and the count is never passed."""
        TrialState = self.optuna.trial.TrialState
        with contextlib.closing(lock(self.out / ".next.lock")):
            trials = self.study.get_trials(deepcopy=False)
            for t in trials:
                if t.state != TrialState.RUNNING:
                    continue
                owner = t.user_attrs.get("sweeper")
                if owner is None:  # a process that died between asking and naming itself
                    self.study.tell(t.number, state=TrialState.FAIL)
                    continue
                orphan = owner != self.name and lock(self.out / ".sweepers" / owner, wait=False)
                if orphan:
                    orphan.close()
                    trial = self.optuna.trial.Trial(self.study, t._trial_id)
                    trial.set_user_attr("sweeper", self.name)
                    return trial, t.params, set(t.intermediate_values)
            finished_or_running = [t for t in trials if t.state != TrialState.WAITING]
            if len(finished_or_running) >= self.args.trials:
                return None
            trial = self.study.ask()
            params = suggest(trial, self.space)
            folder = self.out / f"trial-{trial.number:04d}"
            trial.set_user_attr("command", trial_command(self.args, folder, params))
            trial.set_user_attr("sweeper", self.name)
            return trial, params, None

    def run_trial(self, trial, params, reported):
        """Launch the trial, report each epoch's metric to the pruner, and SIGTERM it once the
        pruner says so. Its output goes to launch.log. reported: the epochs reported before by a
        trial that continues (launched again with --resume latest); None: a new trial."""
        resume, reported = reported is not None, reported or set()
        command = trial.user_attrs["command"]
        folder = Path(trial_folder(trial))
        folder.mkdir(parents=True, exist_ok=True)
        if resume:
            stop_leftover_run(folder)
        shown = ", ".join(f"{k} {show(v)}" for k, v in params.items())
        print(f"trial {trial.number}: {shown}" + (" (continued)" if resume else ""), flush=True)
        port = ["--main_process_port", str(free_port())]  # two trials on one machine: two ports
        launch = command[:2] + port + command[2:] + (["--resume", "latest"] if resume else [])
        start, pruned = time.perf_counter(), False
        with open(folder / "launch.log", "a") as log:
            log.write(f"$ {shlex.join(launch)}\n")
            log.flush()
            # A process group of its own: the pruner's SIGTERM reaches the launcher and the recipe,
            # and not this process. Ctrl-C reaches the trial through Stop.
            env = {"TQDM_DISABLE": "1", **os.environ}  # no progress bars in launch.log
            proc = subprocess.Popen(
                launch, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            self.stop.trial = proc
            while True:
                done = proc.poll() is not None
                values, keys = epoch_values(folder / "metrics.jsonl", self.args.metric)
                for epoch in sorted(set(values) - reported):
                    trial.report(values[epoch], epoch)
                    reported.add(epoch)
                    last = epoch >= planned_epochs(folder)  # nothing left to save by stopping
                    if not (pruned or done or last) and trial.should_prune():
                        os.killpg(proc.pid, signal.SIGTERM)  # stops at a checkpoint
                        pruned = True
                if done:
                    break
                time.sleep(self.args.poll_s)
            self.stop.trial = None
        # A launcher stopped by a signal can end before its recipe, which may still be writing its
        # checkpoint: the recipe holds output_dir/.lock until it exits (common/outputs.py).
        lock(folder / ".lock").close()
        seconds = time.perf_counter() - start
        TrialState = self.optuna.trial.TrialState
        if proc.returncode == 0:  # trained to its end, even if the pruner spoke at the last epoch
            if not values:
                self.study.tell(trial, state=TrialState.FAIL)
                raise SweepError(
                    f"trial {trial.number}'s metrics.jsonl has no {self.args.metric!r}: pass "
                    f"--metric with one of {', '.join(sorted(keys)) or 'its keys'}"
                )
            best = (max if self.args.direction == "maximize" else min)(values.values())
            self.study.tell(trial, best)
            self.failures = 0
            print(
                f"trial {trial.number}: {self.args.metric} {best:.4f} "
                f"(best of {len(values)} epochs, {seconds:.0f} s)",
                flush=True,
            )
        elif pruned:
            self.study.tell(trial, state=TrialState.PRUNED)
            print(f"trial {trial.number}: pruned after epoch {max(values)} ({seconds:.0f} s)")
        elif self.stop.signal is not None:  # left running in the study, for the next sweep
            print(f"trial {trial.number}: stopped at a checkpoint; the same command continues it")
        else:
            self.failed(trial, f"exit {proc.returncode}: {last_error(folder / 'launch.log')}")

    def failed(self, trial, why):
        self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        self.failures += 1
        print(f"trial {trial.number}: failed ({why})", flush=True)
        if self.failures >= self.args.max_failures:
            raise SweepError(
                f"{self.failures} trials in a row failed, the last with {why}: fix the command "
                f"(see {trial_folder(self.study.trials[trial.number])}/launch.log)"
            )

    def run(self):
        while self.stop.signal is None:
            taken = self.next_trial()
            if taken is None:
                break
            self.run_trial(*taken)
        print_table(self.study, self.space, self.args.metric)
        if self.stop.signal is not None:
            print("stopped: run the same command to continue the study")
            return 130
        return 0


def trial_folder(trial):
    """The trial's output_dir, from the command it was given."""
    command = trial.user_attrs["command"]
    return command[command.index("--output_dir") + 1]


def stop_leftover_run(folder):
    """A trial whose sweep process was killed (kill -9) may still be training on this machine:
    its recipe holds output_dir/.lock. Stop it with SIGTERM (it writes a checkpoint) and wait,
    so that the trial continues from there."""
    held = lock(folder / ".lock", wait=False)
    if held is not None:
        held.close()
        return
    owner = (folder / ".lock").read_text().split()  # "process PID on HOST", common/outputs.py
    print(f"{folder}: the run of a sweep that was killed is still going ({' '.join(owner)})")
    if len(owner) == 4 and owner[3] == socket.gethostname():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(owner[1]), signal.SIGTERM)
    lock(folder / ".lock").close()  # waits for it to end


def planned_epochs(folder):
    """The epochs the trial's run is set to train, from the config.yaml it wrote as it started."""
    import yaml

    config = yaml.safe_load((Path(folder) / "config.yaml").read_text())
    return 1 if config.get("smoke") else config["epochs"]


def last_error(log_path):
    lines = Path(log_path).read_text(errors="replace").strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    return (errors or lines or ["no output"])[-1][:300]


def show(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_table(study, space, metric):
    """Every trial of the study: its number, state, value and settings; then the best one's
    command."""
    names = [name for name, _, _ in space]
    header = ["trial", "state", metric, *names]
    rows = [
        [
            str(t.number),
            t.state.name.lower(),
            "" if t.value is None else f"{t.value:.4f}",
            *(show(t.params[n]) if n in t.params else "" for n in names),
        ]
        for t in study.trials
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    complete = [t for t in study.trials if t.value is not None and t.state.name == "COMPLETE"]
    if complete:
        best = study.best_trial
        print(f"best: trial {best.number}, {metric} {best.value:.4f}:")
        print(f"  {shlex.join(best.user_attrs['command'])}")


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description="An Optuna study over a recipe: each trial a real launch (docs/sweeps.md).",
        usage="%(prog)s --study NAME --param NAME=KIND:ARGS [...] -- RECIPE.py [ITS SETTINGS]",
    )
    parser.add_argument("--study", required=True, help="the study's name")
    parser.add_argument("--param", action="append", default=[], help="NAME=KIND:ARGS, repeated")
    parser.add_argument("--metric", default="accuracy", help="a key of metrics.jsonl")
    parser.add_argument("--direction", choices=("maximize", "minimize"), default="maximize")
    parser.add_argument("--trials", type=int, default=20, help="trials in the study, all told")
    parser.add_argument("--config_file", default="accelerate_configs/cpu.yaml")
    parser.add_argument("--out", default=None, help="default runs/sweeps/STUDY")
    parser.add_argument("--storage", default=None, help="default OUT/study.db")
    parser.add_argument("--pruner", choices=PRUNERS, default="median")
    parser.add_argument("--prune_after", type=int, default=5, help="median: trials before any")
    parser.add_argument("--prune_warmup", type=int, default=0, help="median: epochs before any")
    parser.add_argument("--seed", type=int, default=None, help="the sampler's; one process only")
    parser.add_argument("--max_failures", type=int, default=3, help="failed trials in a row")
    parser.add_argument("--poll_s", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv[:split])
    args.recipe = argv[split + 1 :]
    if not args.recipe or not args.recipe[0].endswith(".py"):
        raise SweepError(
            "give the recipe after --, as after accelerate launch: -- recipes/mnist.py"
        )
    if not args.param:
        raise SweepError(
            "nothing to search: add --param NAME=KIND:ARGS, such as lr=loguniform:1e-4:1e-1"
        )
    fixed = {a[2:] for a in args.recipe[1:] if a.startswith("--")}
    for name in ["output_dir", *(p.partition("=")[0] for p in args.param)]:
        if name in fixed:
            raise SweepError(
                f"--{name} is given after -- and set by the sweep: leave it out of the recipe's "
                f"settings"
            )
    if not Path(args.config_file).is_file():
        raise SweepError(f"accelerate config {args.config_file} not found: check --config_file")
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
        try:
            import optuna
        except ImportError:
            raise SweepError(f"sweeps need the optuna package: {INSTALL}") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        code = Sweep(args, optuna).run()
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
