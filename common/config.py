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
message, with a hint for names known from other scripts (ALIASES) or close to a field's.
`-h` or `--help` anywhere raises ShowHelp, whose text (help_text) lists every field with
its type, default and comment, read from the source. Nothing here prints or exits.
"""

import ast
import dataclasses
import difflib
import inspect
import io
import math
import os
import re
import shlex
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml


class UserError(Exception):
    """Bad input from the user: one line that names the problem and the fix, which
    `common.runtime.run` prints once, without a traceback, exiting with status 2."""


class ConfigError(UserError):
    """A setting is unknown, of the wrong type, or out of range."""


class ShowHelp(Exception):
    """`-h` or `--help` was given; str() is the help text (help_text). Not a UserError:
    `common.runtime.run` prints it and exits with status 0."""


# Names that users bring from pytorch/examples, the Hugging Face scripts and Trainer, and
# Lightning -> our field. An unknown name gets "did you mean FIELD?" when the class being
# parsed has FIELD; other names get difflib's closest field. `_split_argv` has already
# turned "-" into "_", so --test-batch-size arrives here as test_batch_size.
ALIASES = {
    # batch sizes
    **dict.fromkeys(
        ["test_batch_size", "val_batch_size", "valid_batch_size", "per_device_eval_batch_size"],
        "eval_batch_size",
    ),
    **dict.fromkeys(["train_batch_size", "per_device_train_batch_size"], "batch_size"),
    # length of training
    **dict.fromkeys(["num_train_epochs", "num_epochs", "n_epochs", "max_epochs"], "epochs"),
    **dict.fromkeys(["max_train_steps", "num_train_steps"], "max_steps"),
    **dict.fromkeys(
        ["gradient_accumulation", "accumulate_grad_batches"], "gradient_accumulation_steps"
    ),
    # optimizer
    "learning_rate": "lr",
    "wd": "weight_decay",
    **dict.fromkeys(["max_grad_norm", "gradient_clip_val", "clip_grad_norm"], "grad_clip"),
    **dict.fromkeys(["lr_scheduler_type", "lr_scheduler"], "scheduler"),
    # data
    **dict.fromkeys(["dataset_name", "data_dir"], "dataset"),
    "image_column_name": "image_column",
    "label_column_name": "label_column",
    **dict.fromkeys(["workers", "dataloader_num_workers"], "num_workers"),
    "classes": "num_classes",
    "validation": "val_fraction",
    # logging
    **dict.fromkeys(["log_interval", "logging_steps", "print_freq", "log_freq"], "log_every"),
    **dict.fromkeys(["report_to", "with_tracking"], "log_with"),
    # checkpoints, output, modes
    **dict.fromkeys(["save_steps", "checkpointing_steps"], "checkpoint_every_steps"),
    "save_total_limit": "keep_checkpoints",
    "resume_from_checkpoint": "resume",
    **dict.fromkeys(["output", "out_dir", "save_dir", "logging_dir"], "output_dir"),
    **dict.fromkeys(["load", "pretrained_weights"], "weights"),
    **dict.fromkeys(["dry_run", "fast_dev_run"], "smoke"),
    "evaluate": "eval_only",
    "ddp_timeout": "dist_timeout_s",
}

# Names that are no setting here, with what to do instead (the hint, whatever the class).
_NOT_SETTINGS = {
    "save_model": "not needed: the weights are always written, as output_dir/model.safetensors",
    **dict.fromkeys(
        ["fp16", "bf16", "amp", "mixed_precision"],
        "precision comes from the accelerate config: accelerate launch --config_file "
        "FILE.yaml, or --mixed_precision bf16",
    ),
    **dict.fromkeys(
        ["no_cuda", "no_accel", "no_mps", "cpu", "use_cpu", "gpu", "gpus", "device", "accel"],
        "devices come from the accelerate config: accelerate launch --config_file "
        "FILE.yaml, or --cpu for CPU only",
    ),
    **dict.fromkeys(
        [
            "world_size",
            "rank",
            "local_rank",
            "dist_url",
            "dist_backend",
            "multiprocessing_distributed",
            "num_processes",
            "nproc_per_node",
        ],
        "processes come from the launcher: accelerate launch --num_processes N, "
        "or torchrun --nproc_per_node N",
    ),
}


def _hint(name, fields):
    """ " (did you mean FIELD?)" or " (what to do instead)" for an unknown `name`, or ""."""
    key = str(name).replace("-", "_")
    if key in _NOT_SETTINGS and key not in fields:
        return f" ({_NOT_SETTINGS[key]})"
    if ALIASES.get(key) in fields:
        return f" (did you mean {ALIASES[key]}?)"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    close = close or [n for n in fields if n.startswith(key[:3])]
    return f" (did you mean {close[0]}?)" if close else ""


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


AUTO_KINDS = (bool, float)  # an Optional of these takes auto: the run decides (None)


def _a(kind, optional=False):
    if kind is bool and optional:
        return "a bool (true/false) or auto"
    if kind is float and optional:
        return "a float or auto"
    return {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false)"}[kind]


def _convert(value, kind, *, optional, where):
    """Convert a YAML value or a command-line string to the field's type, or raise ConfigError.
    An Optional[bool] or Optional[float] takes auto (or none) too: None, which the recipe resolves
    when it runs."""
    empty = {"none", "null", "auto"} if kind in AUTO_KINDS else {"none", "null"}
    if value is None or (isinstance(value, str) and optional and value.lower() in empty):
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
    raise ConfigError(f"{where} must be {_a(kind, optional)}, got {value!r}")


def _split_argv(argv, positional=None):
    """['--a', '1', '--b=2', '--flag'] -> [('a', '1'), ('b', '2'), ('flag', None)]. positional:
    the field that one argument without a --name sets, if any."""
    pairs, i, given = [], 0, None
    while i < len(argv):
        arg = argv[i]
        if positional and not arg.startswith("-") and given is None:
            pairs.append((positional, arg))
            given, i = arg, i + 1
            continue
        if not arg.startswith("--") or arg == "--":
            if positional:
                raise ConfigError(
                    f"unexpected argument {arg!r} after {given!r}: give one {positional} pattern, "
                    f"quoted so that the shell leaves it alone, like 'photos/*.jpg'"
                )
            raise ConfigError(
                f"unexpected argument {arg!r}: settings are given as --name value or --name=value"
            )
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
        raise ConfigError(
            f"config file {path} must hold a mapping of field: value, not {type(data).__name__}"
        )
    return data


def parse_config(cls, argv=None, positional=None):
    """Build a `cls` instance from its defaults, then `--config FILE`, then `--field value` pairs.
    positional: the field that one argument without a --name sets (a serving file's image glob:
    `unet_predict.py --weights W "photos/*.jpg"`); without it, such an argument is an error.

    `-h` or `--help` anywhere in argv raises ShowHelp(help_text(cls)) before any other check.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        raise ShowHelp(help_text(cls))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    pairs = _split_argv(argv, positional)
    # A training Config's SERVING_SETTINGS: the settings its serving file holds ({name: file}),
    # which a config.yaml of an older run may still list (they train nothing: skipped there).
    serving = {n: f for n, f in getattr(cls, "SERVING_SETTINGS", {}).items() if n not in fields}

    def check_name(name, source):
        if name in serving:
            raise ConfigError(
                f"{name} is a setting of {serving[name]} (predict, export, the data check): add "
                f"--predict, --export or --check_data, or run {serving[name]}"
            )
        if name not in fields:
            hint = _hint(name, fields)
            raise ConfigError(
                f"unknown setting {name!r} in {source}{hint}; valid settings: {', '.join(fields)}"
            )

    values = {}
    config_files = [v for n, v in pairs if n == "config"]
    if len(config_files) > 1:
        raise ConfigError("--config given more than once: pass one YAML file")
    if config_files:
        if config_files[0] is None:
            raise ConfigError("--config needs a path to a YAML file")
        for name, value in read_yaml(config_files[0]).items():
            if name in serving:
                continue
            check_name(name, config_files[0])
            kind, optional = _field_type(cls, fields[name])
            where = f"{name} in {config_files[0]}"
            values[name] = _convert(value, kind, optional=optional, where=where)

    for name, value in pairs:
        if name == "config":
            continue
        check_name(name, "the command line")
        kind, optional = _field_type(cls, fields[name])
        if value is None and kind is bool:
            value = True
        elif value is None:
            raise ConfigError(f"--{name} needs a value")
        values[name] = _convert(value, kind, optional=optional, where=f"--{name}")

    cfg = cls(**values)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


_WIDTH = 110  # help_text wraps longer lines


def _class_notes(klass):
    """From the source of one dataclass: its docstring's first paragraph, and per field declared in
    its body (field comment, section comment), where the section is the last run of comment lines
    on lines of their own before the field. Nothing if the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
        node = ast.parse(source).body[0]
        comments = {}  # line number -> (comment text, alone on its line)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                alone = not tok.line[: tok.start[1]].strip()
                comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    except (OSError, TypeError, SyntaxError, IndexError, tokenize.TokenError):
        return "", {}
    if not isinstance(node, ast.ClassDef):
        return "", {}
    doc = (ast.get_docstring(node) or "").split("\n\n")[0]
    fields, section, previous_end = {}, None, node.lineno
    for stmt in node.body:
        start = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
        above = [
            comments[n][0]
            for n in range(previous_end + 1, start)
            if comments.get(n, ("", False))[1]
        ]
        if above:
            section = " ".join(above)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            inline = [
                comments[n][0]
                for n in range(stmt.lineno, stmt.end_lineno + 1)
                if n in comments and not comments[n][1]
            ]
            fields[stmt.target.id] = (" ".join(inline), section)
        previous_end = stmt.end_lineno
    return " ".join(doc.split()), fields


def _for_users(comment):
    """A source comment as help text: the `ADAPT:` notes are for whoever copies the recipe."""
    return re.sub(r"ADAPT: *(\w)", lambda m: m.group(1).upper(), comment)


def _show(value):
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def _script(cls):
    """The source file of `cls` as one would type it: relative to the working directory if in it."""
    try:
        inspect.getsourcelines(cls)  # the file defines cls (make_dataclass's say module "types")
        path = os.path.abspath(inspect.getsourcefile(cls))
    except (OSError, TypeError):
        return "RECIPE.py"
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def help_text(cls):
    """What `--help` shows: a usage line, where settings come from, then every field of the
    dataclass `cls` (inherited ones too) as `  --name TYPE (default: VALUE)  comment`, in the order
    they are defined, under the section comments of the source. A field declared again in a
    subclass keeps its place, with the subclass's default and comment."""
    classes = [k for k in reversed(cls.__mro__) if "__dataclass_fields__" in vars(k)]
    notes = {k: _class_notes(k) for k in classes}
    lines = [
        f"usage: python {_script(cls)} [--config FILE.yaml] [--name value ...]",
        "Settings: the defaults, then --config YAML, then the command line; machine settings: the "
        "accelerate config.",
        "A BOOL alone (--smoke) means true; none clears a setting whose default is none; auto",
        "leaves a BOOL whose default is auto to the run, to decide from data, weights and device.",
    ]
    shown = None
    for f in dataclasses.fields(cls):
        declared = [k for k in classes if f.name in vars(k).get("__annotations__", {})] or [cls]
        first, last = declared[0], declared[-1]  # where it sits, and whose comment it takes
        section = notes.get(first, ("", {}))[1].get(f.name, ("", None))[1]
        if (first, section) != shown:
            shown = (first, section)
            heading = section or notes.get(first, ("", {}))[0] or f"{first.__name__}:"
            lines += ["", *textwrap.wrap(_for_users(heading), _WIDTH, break_on_hyphens=False)]
        comment = notes.get(last, ("", {}))[1].get(f.name, ("", None))[0]
        kind, optional = _field_type(cls, f)
        name = getattr(kind, "__name__", str(kind)).upper()
        if f.default is None and kind in AUTO_KINDS and optional:
            default = "default: auto"
        elif f.default is not dataclasses.MISSING:
            default = f"default: {_show(f.default)}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default: {_show(f.default_factory())}"
        else:
            default = "required"
        head = f"  --{f.name} {name} ({default})"
        if not comment:
            lines.append(head)
        else:
            lines += textwrap.wrap(
                _for_users(comment),
                _WIDTH,
                initial_indent=f"{head}  ",
                subsequent_indent=" " * 6,
                break_long_words=False,
                break_on_hyphens=False,
            )
    return "\n".join(lines)


def require(condition, message):
    """Raise ConfigError(message) unless `condition`; for a recipe's `validate()`."""
    if not condition:
        raise ConfigError(message)


def require_at_least(cfg, minimum, *names):
    """ConfigError "NAME must be at least MINIMUM, got VALUE" for the first field below it."""
    for name in names:
        value = getattr(cfg, name)
        require(value >= minimum, f"{name} must be at least {minimum}, got {value}")


def shell_flag(name, value):
    """`--name value` as a message suggests it, safe to paste into a shell: a value that the
    shell would read otherwise, such as #000000 (a comment to bash) or a path with spaces, is
    quoted (shlex.quote)."""
    return f"--{name} {shlex.quote(str(value))}"


@dataclass
class RunConfig:
    """The settings that every recipe shares: how long to train, checkpoints, modes, logging.
    A recipe's Config subclasses it and adds its own fields (data, model, optimizer), which
    must include epochs, batch_size, eval_batch_size, lr, seed and num_workers. A field
    declared again in the recipe takes the recipe's default."""

    deterministic: bool = False  # bit-repeatable GPU runs, slower (common/determinism.py)
    max_steps: int = 0  # stop after this many optimizer steps (0: train all epochs)
    ema_decay: float = 0.0  # also keep a moving average of the weights, e.g. 0.999; 0: off
    early_stop_patience: int = 0  # stop after this many evaluations without a better metric; 0: off
    # The batch of an optimizer step: batch_size per process x processes x accumulation steps. Or
    # global_batch_size samples on any number of processes: batch_size then caps a process's
    # batch, and the accumulation steps are worked out (docs/resume.md#any-number-of-processes).
    global_batch_size: int = 0  # samples per optimizer step on any process count; 0: off
    gradient_accumulation_steps: int = 1  # optimizer step every N batches
    scale_lr: bool = False  # multiply lr by processes x accumulation steps (linear scaling rule)
    # Checkpoints (output_dir/checkpoints/step-N): the full state, for an exact resume.
    checkpoint_every_steps: int = 0  # also one every N optimizer steps (0: only at epoch ends)
    keep_checkpoints: int = 3  # delete older ones
    resume: str | None = None  # "latest" or a checkpoint folder (torchrun restarts: the last)
    # Modes.
    smoke: bool = False  # train smoke_steps steps of one epoch, then evaluate: for tests and CI
    smoke_steps: int = 5
    overfit_batches: int = 0  # train and evaluate on the first N batches' samples, unaugmented
    eval_only: bool = False  # evaluate `weights` (or the `resume` checkpoint) and stop
    weights: str | None = None  # model.safetensors (or a state_dict .pt) to start from
    export: str = ""  # onnx: write `weights` as a checked .onnx file beside it (docs/export.md)
    predict: str | None = None  # image files (a glob) to label with --weights; see the recipe
    check_data: bool = False  # print the data's classes and notes, draw output_dir/data_check.png
    # Logging: metrics.jsonl is always written; log_with also sends it to a tracker.
    log_with: str = "none"  # none, tensorboard or wandb (requirements-extras.txt)
    log_every: int = 50  # optimizer steps between logged training scalars
    dist_timeout_s: int = 600  # a rank stuck this long in a collective stops the job
    debug: bool = False  # show full tracebacks for user errors

    def validate(self):
        """The checks every recipe needs; a recipe's validate() calls this, then adds its own."""
        require_at_least(
            self,
            1,
            "epochs",
            "batch_size",
            "gradient_accumulation_steps",
            "smoke_steps",
            "log_every",
            "keep_checkpoints",
        )
        # 0: a recipe that sizes its evaluation batches itself (the U-Net's, by pixels).
        require_at_least(self, 0 if type(self).eval_batch_size == 0 else 1, "eval_batch_size")
        require_at_least(
            self,
            0,
            "global_batch_size",
            "max_steps",
            "checkpoint_every_steps",
            "early_stop_patience",
            "overfit_batches",
        )
        require(
            not (self.global_batch_size and self.scale_lr),
            "global_batch_size keeps the samples of an optimizer step the same on any number of "
            "processes, so the learning rate needs no scaling: leave scale_lr off",
        )
        require(
            0 <= self.ema_decay < 1,
            f"ema_decay must be in [0, 1), such as 0.999, got {self.ema_decay}",
        )
        lowest = -1 if type(self).num_workers == -1 else 0  # -1: a recipe that picks them by CPUs
        require(
            self.num_workers >= lowest,
            f"num_workers must be at least {lowest}, got {self.num_workers}",
        )
        if type(self).lr == 0:  # a recipe whose lr 0 is its model's own
            require(self.lr >= 0, f"lr must be positive (0: the model's own), got {self.lr}")
        else:
            require(self.lr > 0, f"lr must be positive, got {self.lr}")
        require(
            not (self.weights and self.resume),
            "weights and resume both load a model: pass one of them",
        )
        require(
            not self.eval_only or self.weights or self.resume,
            "eval_only needs --weights FILE or --resume CHECKPOINT",
        )
        require(self.export in ("", "onnx"), f"export must be onnx, got {self.export!r}")
        require(
            not self.export or self.weights,
            "export needs weights: add --weights PATH/model.safetensors",
        )
        require(not (self.export and self.eval_only), "choose one of export and eval_only")
        require(
            not self.export or not self.weights.endswith(".onnx"),
            "export reads the weights the .onnx file was made from: pass the .safetensors",
        )
        require(not self.predict or self.weights, "predict needs weights: add --weights FILE")
        require(not (self.predict and self.eval_only), "choose one of predict and eval_only")
        require(not (self.predict and self.export), "choose one of predict and export")
        modes = [m for m in ("check_data", "eval_only", "predict", "export") if getattr(self, m)]
        require(len(modes) < 2 or "check_data" not in modes, f"choose one of {' and '.join(modes)}")

    def split_global_batch(self, processes):
        """This config as `processes` processes train it. With global_batch_size B: batch_size
        becomes the largest per-process batch, up to the one given, that divides B / processes,
        and gradient_accumulation_steps the rest, so that batch x processes x steps = B (a
        ConfigError if processes does not divide B). Without it: the config as it is."""
        total = self.global_batch_size
        if not total:
            return self
        require(
            total % processes == 0,
            f"global_batch_size {total} does not split evenly over {processes} processes: use a "
            f"multiple of {processes}, or a process count that divides {total}",
        )
        share = total // processes
        batch = max(n for n in range(1, min(share, self.batch_size) + 1) if share % n == 0)
        return dataclasses.replace(
            self, batch_size=batch, gradient_accumulation_steps=share // batch
        )

    def scaled_lr(self, processes):
        """lr, times processes x accumulation steps with scale_lr (the linear scaling rule)."""
        return self.lr * (processes * self.gradient_accumulation_steps if self.scale_lr else 1)

    def overfit_samples(self, processes):
        """overfit_batches: the training samples of each process's first N batches (of its
        batch_size, as with a single process; with global_batch_size, the first N optimizer
        steps' samples on any process count), which it trains and evaluates on; 0: off."""
        return self.overfit_batches * (self.global_batch_size or self.batch_size * processes)

    def limits(self):
        """(epochs, optimizer steps) the run trains for, counted from its start, also when
        resumed; smoke: smoke_steps steps of one epoch."""
        return (1, self.smoke_steps) if self.smoke else (self.epochs, self.max_steps or math.inf)


def save_config(cfg, path):
    """Write the effective config as YAML, so a run can be repeated with --config PATH."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
