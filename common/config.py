"""Config: dataclass defaults <- YAML file <- command line, strictly checked.

A recipe declares its settings once, as a dataclass with a comment per field:

    @dataclass
    class Config:
        lr: float = 1e-3   # AdamW learning rate
        ...

    cfg = parse_config(Config)          # reads sys.argv
    cfg = parse_config(Config, ["--config", "run.yaml", "--lr", "3e-4"])

`--config FILE` is applied first, then every `--field value` or `--field=value`,
whatever their order. Field names are the same in YAML and on the command line.
Unknown keys, wrong types and missing files raise ConfigError with a one-line
message; nothing here prints or exits.
"""

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml


class UserError(Exception):
    """Bad input from the user. The message is one line that names the problem and the fix.

    `common.runtime.run` prints it once, without a traceback, and exits with status 2.
    """


class ConfigError(UserError):
    """A setting is unknown, of the wrong type, or out of range."""


_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}


def _field_type(cls, f):
    """The plain type of a field (int, float, str, bool), and whether None is allowed."""
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def _a(kind):
    return {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}[kind]


def _convert(value, kind, optional, where):
    """Convert a YAML value or a command-line string to the field's type, or raise ConfigError."""
    if value is None or (isinstance(value, str) and optional and value.lower() in {"none", "null"}):
        if optional:
            return None
        raise ConfigError(f"{where} must be {_a(kind)}, not empty")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"config fields must be int, float, str or bool (or Optional), got {kind}")
    raise ConfigError(f"{where} must be {_a(kind)}, got {value!r}")


def _split_argv(argv):
    """['--a', '1', '--b=2', '--flag'] -> [('a', '1'), ('b', '2'), ('flag', None)]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: settings are given as --name value or --name=value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        else:
            value = None  # a bare flag: only valid for bool fields
        pairs.append((name.replace("-", "_"), value))
        i += 1
    return pairs


def read_yaml(path):
    """Load a YAML mapping from `path`, with one-line errors for the usual mistakes."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: check the path given to --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value, not {type(data).__name__}")
    return data


def parse_config(cls, argv=None):
    """Build a `cls` instance from its defaults, then `--config FILE`, then `--field value` pairs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    pairs = _split_argv(argv)

    def check_name(name, source):
        if name not in fields:
            close = [n for n in fields if n.startswith(name[:3])]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown setting {name!r} in {source}{hint}; valid settings: {', '.join(fields)}")

    values = {}
    config_files = [v for n, v in pairs if n == "config"]
    if len(config_files) > 1:
        raise ConfigError("--config given more than once: pass one YAML file")
    if config_files:
        if config_files[0] is None:
            raise ConfigError("--config needs a path to a YAML file")
        for name, value in read_yaml(config_files[0]).items():
            check_name(name, config_files[0])
            kind, optional = _field_type(cls, fields[name])
            values[name] = _convert(value, kind, optional, f"{name} in {config_files[0]}")

    for name, value in pairs:
        if name == "config":
            continue
        check_name(name, "the command line")
        kind, optional = _field_type(cls, fields[name])
        if value is None and kind is bool:
            value = True
        elif value is None:
            raise ConfigError(f"--{name} needs a value")
        values[name] = _convert(value, kind, optional, f"--{name}")

    cfg = cls(**values)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def require(condition, message):
    """Raise ConfigError(message) unless `condition`; for a recipe's `validate()`."""
    if not condition:
        raise ConfigError(message)


def require_at_least(cfg, minimum, *names):
    """ConfigError "NAME must be at least MINIMUM, got VALUE" for the first field below `minimum`."""
    for name in names:
        value = getattr(cfg, name)
        require(value >= minimum, f"{name} must be at least {minimum}, got {value}")


@dataclass
class RunConfig:
    """The settings that every recipe shares: how long to train, checkpoints, modes, logging.

    A recipe's Config subclasses it and adds its own fields (data, model, optimizer), which
    must include epochs, batch_size, eval_batch_size, lr, seed and num_workers. A field
    declared again in the recipe takes the recipe's default.
    """

    gradient_accumulation_steps: int = 1  # optimizer step every N batches
    scale_lr: bool = False  # multiply lr by processes x accumulation steps (linear scaling rule)
    deterministic: bool = False  # bit-repeatable GPU runs, slower (common/determinism.py)
    max_steps: int = 0  # stop after this many optimizer steps (0: train all epochs)
    # Checkpoints (output_dir/checkpoints/step-N): the full state, for an exact resume.
    checkpoint_every_steps: int = 0  # also write one every N optimizer steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # delete older ones
    resume: Optional[str] = None  # "latest" or a checkpoint folder (torchrun restarts: this job's last)
    # Modes.
    smoke: bool = False  # train smoke_steps steps of one epoch, then evaluate: for tests and CI
    smoke_steps: int = 5
    eval_only: bool = False  # evaluate `weights` (or the `resume` checkpoint) and stop
    weights: Optional[str] = None  # model.safetensors (or a state_dict .pt) to start from
    # Logging: metrics.jsonl is always written; log_with also sends it to a tracker.
    log_with: str = "none"  # none, tensorboard (requirements-extras.txt) or wandb (pip install wandb)
    log_every: int = 50  # optimizer steps between logged training scalars
    dist_timeout_s: int = 600  # a rank stuck this long in a collective stops the job
    debug: bool = False  # show full tracebacks for user errors

    def validate(self):
        """The checks every recipe needs; a recipe's validate() calls this, then adds its own."""
        require_at_least(self, 1, "epochs", "batch_size", "eval_batch_size", "gradient_accumulation_steps",
                         "smoke_steps", "log_every", "keep_checkpoints")
        require_at_least(self, 0, "num_workers", "max_steps", "checkpoint_every_steps")
        require(self.lr > 0, f"lr must be positive, got {self.lr}")
        require(not (self.weights and self.resume), "weights and resume both load a model: pass one of them")
        require(not self.eval_only or self.weights or self.resume,
                "eval_only needs --weights FILE or --resume CHECKPOINT")

    def scaled_lr(self, processes):
        """lr, times processes x accumulation steps with scale_lr (the linear scaling rule)."""
        return self.lr * (processes * self.gradient_accumulation_steps if self.scale_lr else 1)

    def limits(self):
        """(epochs, optimizer steps) the run trains for, counted from its start, also when
        resumed; smoke: smoke_steps steps of one epoch."""
        return (1, self.smoke_steps) if self.smoke else (self.epochs, self.max_steps or math.inf)


def save_config(cfg, path):
    """Write the effective config as YAML, so a run can be repeated with --config PATH."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
