"""The config contract: defaults <- --config YAML <- --field value, strictly checked."""

from dataclasses import dataclass
from typing import Optional

import pytest

from common.config import ConfigError, parse_config
from conftest import launch


@dataclass
class Toy:
    lr: float = 0.1
    epochs: int = 3
    name: str = "a"
    smoke: bool = False
    weights: Optional[str] = None


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


def test_bad_yaml_is_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text("lr: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line"):
        parse_config(Toy, ["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "unknown.yaml").write_text("lr: 1\nbatchsize: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'batchsize' in .*unknown.yaml"):
        parse_config(Toy, ["--config", str(tmp_path / "unknown.yaml")])
    (tmp_path / "typed.yaml").write_text("epochs: '5'\nsmoke: 1.5\n")
    with pytest.raises(ConfigError, match="smoke in .*typed.yaml must be a bool \\(true/false\\), got 1.5"):
        parse_config(Toy, ["--config", str(tmp_path / "typed.yaml")])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch_size", "0"], "batch_size must be at least 1, got 0"),
        (["--lr", "-1"], "lr must be positive, got -1.0"),
        (["--eval_only"], "eval_only needs --weights FILE or --resume CHECKPOINT"),
        (["--bogus", "1"], "unknown setting 'bogus'"),
        (["--dataset", "./no/such/dir"], "dataset path ./no/such/dir does not exist"),
        (["--dataset", "ylecun/mnist"], "point --dataset at a local folder"),
    ],
)
def test_the_recipe_reports_bad_input_in_one_line(args, message, tmp_path):
    res = launch(["recipes/mnist.py", "--output_dir", tmp_path, *args], launcher="python")
    assert res.returncode == 2, res
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res
