"""The config contract: defaults <- --config YAML <- --field value, strictly checked."""

import dataclasses
import re
import socket
import sys
from dataclasses import dataclass

import pytest
from conftest import launch, run_here
from recipe_module import load_recipe

from common.config import ConfigError, ShowHelp, parse_config
from common.data import DataError


@dataclass
class Toy:
    lr: float = 0.1
    epochs: int = 3
    name: str = "a"
    smoke: bool = False
    weights: str | None = None


@dataclass
class Base:
    """How long to run."""

    steps: int = 0  # stop after this many steps (0: no limit)
    # Checkpoints: the full state, for a resume.
    keep: int = 3  # delete older ones
    tag: str | None = None


@dataclass
class Child(Base):
    # Model.
    width: int = 8  # channels of the first layer; "#" in a comment is kept
    keep: int = 5  # how many to keep here
    name: str = "unet#2"


@pytest.fixture(scope="module")
def mnist():
    """recipes/mnist.py as a module, registered (load_recipe does not) so that inspect finds its
    source."""
    module = load_recipe("mnist")
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_defaults_then_yaml_then_command_line(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 0.5\nepochs: 7\n")
    cfg = parse_config(Toy, ["--epochs=9", "--config", str(tmp_path / "c.yaml"), "--smoke"])
    assert (cfg.lr, cfg.epochs, cfg.name, cfg.smoke, cfg.weights) == (0.5, 9, "a", True, None)
    assert parse_config(Toy, ["--smoke", "false", "--weights", "w.pt", "--lr", "1e-3"]).lr == 1e-3
    assert parse_config(Toy, ["--weights", "none"]).weights is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epoch", "3"], "unknown setting 'epoch' in the command line (did you mean epochs?)"),
        (["--epochs", "three"], "--epochs must be an int, got 'three'"),
        (["--epochs", "2.5"], "--epochs must be an int, got '2.5'"),
        (["--smoke", "maybe"], "--smoke must be a bool (true/false), got 'maybe'"),
        (["--lr"], "--lr needs a value"),
        (["lr", "3"], "unexpected argument 'lr'"),
        (["--config", "nope.yaml"], "config file nope.yaml not found"),
    ],
)
def test_bad_settings_are_rejected(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_config(Toy, argv)
    assert message in str(e.value)


def test_a_serving_file_takes_its_image_glob_without_a_name():
    # `unet_predict.py --weights W "photos/*.jpg"`: one argument without --name sets the field
    # named positional, wherever it stands; a second (a glob the shell expanded) is one line.
    for argv in (["--weights", "w.pt", "a/*.png"], ["a/*.png", "--weights", "w.pt"]):
        cfg = parse_config(Toy, argv, positional="name")
        assert (cfg.name, cfg.weights) == ("a/*.png", "w.pt")
    with pytest.raises(
        ConfigError, match=re.escape("unexpected argument 'a/2.png' after 'a/1.png'")
    ):
        parse_config(Toy, ["a/1.png", "a/2.png"], positional="name")


def test_bad_yaml_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line"):
        parse_config(Toy, ["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "unknown.yaml").write_text("lr: 1\nbatchsize: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'batchsize' in .*unknown.yaml"):
        parse_config(Toy, ["--config", str(tmp_path / "unknown.yaml")])
    (tmp_path / "typed.yaml").write_text("epochs: '5'\nsmoke: 1.5\n")
    with pytest.raises(
        ConfigError, match="smoke in .*typed.yaml must be a bool \\(true/false\\), got 1.5"
    ):
        parse_config(Toy, ["--config", str(tmp_path / "typed.yaml")])


@pytest.mark.parametrize(
    "argv", [["--help"], ["-h"], ["--steps", "x", "--bogus", "-h"], ["--width=2", "--help"]]
)
def test_help_lists_every_field_with_its_default_and_comment(argv):
    with pytest.raises(ShowHelp) as e:
        parse_config(Child, argv)
    text = str(e.value)
    lines = text.splitlines()
    assert lines[0].startswith("usage: python ")
    assert lines[0].endswith("tests/test_config.py [--config FILE.yaml] [--name value ...]")
    assert "--config" in lines[1] and "accelerate config" in lines[1]
    for f in dataclasses.fields(Child):
        assert sum(line.startswith(f"  --{f.name} ") for line in lines) == 1, f.name
    steps = "  --steps INT (default: 0)  stop after this many steps (0: no limit)"
    keep = "  --keep INT (default: 5)  how many to keep here"
    width = '  --width INT (default: 8)  channels of the first layer; "#" in a comment is kept'
    assert steps in lines  # inherited, under the base's docstring
    assert keep in lines and "delete older ones" not in text  # redeclared: the subclass's
    assert "  --tag STR (default: none)" in lines  # no comment
    assert width in lines and "  --name STR (default: unet#2)" in lines
    # Sections in the order the fields are defined: the base class's, then the subclass's.
    order = [
        "How long to run.",
        steps,
        "Checkpoints: the full state, for a resume.",
        keep,
        "  --tag STR (default: none)",
        "Model.",
        width,
    ]
    assert [lines.index(line) for line in order] == sorted(lines.index(line) for line in order)


def test_an_optional_bool_takes_auto_and_says_so_in_the_help(tmp_path):
    @dataclass
    class Layout:
        channels_last: bool | None = None  # auto: on with CUDA

    assert parse_config(Layout, []).channels_last is None
    for value, parsed in (
        ("auto", None),
        ("AUTO", None),
        ("none", None),
        ("true", True),
        ("off", False),
    ):
        assert parse_config(Layout, ["--channels_last", value]).channels_last is parsed, value
    assert parse_config(Layout, ["--channels_last"]).channels_last is True  # a bare flag: true
    (tmp_path / "c.yaml").write_text("channels_last: auto\n")
    assert parse_config(Layout, ["--config", str(tmp_path / "c.yaml")]).channels_last is None
    (tmp_path / "c.yaml").write_text("channels_last: false\n")
    assert parse_config(Layout, ["--config", str(tmp_path / "c.yaml")]).channels_last is False
    with pytest.raises(
        ConfigError,
        match=re.escape("--channels_last must be a bool (true/false) or auto, got 'maybe'"),
    ):
        parse_config(Layout, ["--channels_last", "maybe"])
    with pytest.raises(ShowHelp) as e:
        parse_config(Layout, ["--help"])
    assert "  --channels_last BOOL (default: auto)  auto: on with CUDA" in str(e.value).splitlines()


def test_help_without_the_source_still_lists_the_fields():
    made = dataclasses.make_dataclass("Made", [("n", int, 2), ("tag", str | None, None)])
    with pytest.raises(ShowHelp) as e:
        parse_config(made, ["--help"])
    lines = str(e.value).splitlines()
    assert lines[0] == "usage: python RECIPE.py [--config FILE.yaml] [--name value ...]"
    assert "  --n INT (default: 2)" in lines and "  --tag STR (default: none)" in lines


def test_help_of_the_mnist_recipe(mnist):
    with pytest.raises(ShowHelp) as e:
        parse_config(mnist.Config, ["--epochs", "0", "--help"])
    text = str(e.value)
    lines = text.splitlines()
    assert lines[0].startswith("usage: python ")
    assert lines[0].endswith("recipes/mnist.py [--config FILE.yaml] [--name value ...]")
    assert "  --dataset STR (default: ylecun/mnist)  hub name or local folder" in lines
    assert (
        "  --max_steps INT (default: 0)  stop after this many optimizer steps (0: train all epochs)"
        in lines
    )
    assert "  --epochs INT (default: 14)" in lines
    assert "  --lr FLOAT (default: 1.0)  learning rate; onecycle: its peak" in lines
    smoke = (
        "  --smoke BOOL (default: false)  train smoke_steps steps of one epoch, then evaluate: "
        "for tests and CI"
    )
    assert smoke in lines
    assert (
        "Checkpoints (output_dir/checkpoints/step-N): the full state, for an exact resume." in lines
    )
    for f in dataclasses.fields(mnist.Config):
        assert sum(line.startswith(f"  --{f.name} ") for line in lines) == 1, f.name
    assert max(len(line) for line in lines[1:]) <= 110, text  # lines[0] holds a path


@pytest.mark.parametrize(
    "argv, name, hint",
    [
        (["--test-batch-size", "100"], "test_batch_size", "(did you mean eval_batch_size?);"),
        (["--log-interval", "10"], "log_interval", "(did you mean log_every?);"),
        (["--num_train_epochs", "3"], "num_train_epochs", "(did you mean epochs?);"),
        (["--learning_rate", "0.1"], "learning_rate", "(did you mean lr?);"),
        (["--dry-run"], "dry_run", "(did you mean smoke?);"),
        (
            ["--per_device_train_batch_size=8"],
            "per_device_train_batch_size",
            "(did you mean batch_size?);",
        ),
        (
            ["--save-model"],
            "save_model",
            "(not needed: the weights are always written, as output_dir/model.safetensors);",
        ),
        (["--fp16"], "fp16", "(precision comes from the accelerate config: "),
        (["--batchsize", "8"], "batchsize", "(did you mean batch_size?);"),  # not an alias: difflib
        (["--eval_batch_sizes", "8"], "eval_batch_sizes", "(did you mean eval_batch_size?);"),
    ],
)
def test_names_from_other_scripts_get_a_hint(mnist, argv, name, hint):
    with pytest.raises(ConfigError) as e:
        parse_config(mnist.Config, argv)
    message = str(e.value)
    assert message.startswith(f"unknown setting {name!r} in the command line {hint}")
    assert "); valid settings: " in message
    assert "\n" not in message


def test_an_alias_hints_only_at_a_field_of_the_class(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_config(Toy, ["--test-batch-size", "100"])  # Toy has no eval_batch_size
    assert str(e.value).startswith(
        "unknown setting 'test_batch_size' in the command line; valid settings: "
    )
    with pytest.raises(
        ConfigError,
        match=r"unknown setting 'learning_rate' in the command line \(did you mean lr\?\)",
    ):
        parse_config(Toy, ["--learning-rate", "0.1"])
    (tmp_path / "hf.yaml").write_text("num_train_epochs: 3\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown setting 'num_train_epochs' in .*hf.yaml \(did you mean epochs\?\)",
    ):
        parse_config(Toy, ["--config", str(tmp_path / "hf.yaml")])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch_size", "0"], "batch_size must be at least 1, got 0"),
        (["--lr", "-1"], "lr must be positive, got -1.0"),
        (["--eval_only"], "eval_only needs --weights FILE or --resume CHECKPOINT"),
        (["--bogus", "1"], "unknown setting 'bogus'"),
    ],
)
def test_the_recipe_rejects_bad_settings(mnist, args, message):
    with pytest.raises(ConfigError) as e:
        parse_config(mnist.Config, args)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "dataset, message",
    [
        ("./no/such/dir", "dataset path ./no/such/dir does not exist"),
        ("ylecun/mnist", "point --dataset at a local folder"),
    ],
)
def test_the_recipe_says_where_data_is_missing(mnist, dataset, message):
    with pytest.raises(DataError, match=re.escape(message)):
        mnist.make_loaders(mnist.Config(dataset=dataset))


@pytest.mark.slow
def test_an_unreachable_hub_is_tried_once_where_datasets_was_imported_already(mnist, monkeypatch):
    # As in a notebook: datasets is imported before the recipe finds no internet, so it read
    # HF_HUB_OFFLINE already, and each retry against the hub cost 20 s. The check itself goes to
    # the port of HF_ENDPOINT (conftest: 127.0.0.1:9), not always to 443.
    import datasets  # noqa: F401

    tried = []
    connect = socket.socket.connect
    monkeypatch.setattr(
        socket.socket, "connect", lambda s, address: tried.append(address) or connect(s, address)
    )
    with pytest.raises(DataError, match="point --dataset at a local folder"):
        mnist.make_loaders(mnist.Config(dataset="ylecun/mnist"))
    assert tried == [("127.0.0.1", 9)]


def one_error_line(res):
    """The one line of a run that stopped on bad input, less `python -X importtime`'s lines."""
    lines = [
        line for line in res.output.strip().splitlines() if not line.startswith("import time:")
    ]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res
    return lines[0]


def test_a_bad_setting_and_missing_data_are_one_line_and_load_no_compiler(mnist, tmp_path, capsys):
    # What the two tests above reach the user as. A bad setting stops in run(), before main()
    # and anything it imports: here, in this process, as `python recipes/mnist.py` calls it.
    assert run_here(mnist, ["--output_dir", tmp_path, "--batch_size", 0]) == 2
    assert capsys.readouterr().err == "error: batch_size must be at least 1, got 0\n"
    # Missing data, launched: a run that stops before its optimizer exists has no use for
    # torch's compiler, and importing it cost every such run over a second.
    res = launch(
        [
            "-X",
            "importtime",
            "recipes/mnist.py",
            "--output_dir",
            tmp_path,
            "--dataset",
            "./no/such/dir",
        ],
        launcher="python",
    )
    assert "dataset path ./no/such/dir does not exist" in one_error_line(res)
    imported = {
        line.split("|")[-1].strip()
        for line in res.output.splitlines()
        if line.startswith("import time:")
    }
    assert "torch" in imported and not {"torch._dynamo", "torch._inductor"} & imported


def test_help_lists_every_setting_and_exits_0_without_importing_torchvision():
    res = launch(
        ["-X", "importtime", "recipes/unet.py", "--help", "--bogus", "1"], launcher="python"
    )
    assert res.returncode == 0, res
    imported = {
        line.split("|")[-1].strip()
        for line in res.output.splitlines()
        if line.startswith("import time:")
    }
    assert "torch" in imported and "torchvision" not in imported  # over a second, for nothing
    text = "".join(
        line for line in res.output.splitlines(keepends=True) if not line.startswith("import time:")
    )
    assert text.startswith("usage: python recipes/unet.py"), res
    for line in (
        "--max_steps INT (default: 0)  stop after this many optimizer steps",  # RunConfig
        "--num_classes INT (default: 0)  with background; 0: one per mask value",
        "--base_channels INT (default: 64)  first level's width",  # the recipe's own
        "--log_every INT (default: 20)",
    ):  # redeclared in the recipe
        assert line in text, res


@pytest.mark.slow
def test_predicts_settings_are_the_serving_files_and_an_earlier_config_still_trains(
    mnist, tmp_path
):
    # top_k and predict_csv moved to mnist_predict.py: a config.yaml that an earlier run wrote
    # with them repeats the run, and the command line names the file that takes them.
    earlier = tmp_path / "config.yaml"
    earlier.write_text("epochs: 2\ntop_k: 3\npredict_csv: ''\n")
    assert parse_config(mnist.Config, ["--config", str(earlier)]).epochs == 2
    with pytest.raises(ConfigError) as e:
        parse_config(mnist.Config, ["--top_k", "2"])
    assert str(e.value) == (
        "top_k is a setting of mnist_predict.py (predict, export, the data check): add "
        "--predict, --export or --check_data, or run mnist_predict.py"
    )
    serving = load_recipe("mnist_predict").ServingConfig  # which takes both
    assert parse_config(serving, ["--config", str(earlier), "--top_k", "2"]).top_k == 2
