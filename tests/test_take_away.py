"""`make copy`: a recipe taken out of the repository as a project of its own. The copy's own
tests, run in its folder with nothing of this repository on the path, train it on 1 and 2
processes, resume it mid-epoch, predict and export; ruff passes there."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "copy_recipe.py"
OWN_FILES = {  # the copy's files besides common/, accelerate_configs/ and its tests
    "mnist": {"my_task.py", "my_task_predict.py", "data/mnist_sample", "configs/mnist_fast.yaml"},
    "unet": {
        "my_seg.py",
        "my_seg_predict.py",
        "my_seg_data.py",
        "my_seg_model.py",
        "my_seg_rules.py",
    },
    "text": {"my_text.py", "my_text_predict.py", "my_text_data.py", "my_text_model.py"},
}
NAMES = {"mnist": "my_task", "unet": "my_seg", "text": "my_text"}
# What a copy of one recipe never carries: the other recipes' machinery (common/'s packages for
# segmentation and text).
NOT_CARRIED = {"mnist": {"segmentation", "text"}, "unet": {"text"}, "text": {"segmentation"}}


def copy(recipe, dest, *more):
    return subprocess.run(
        [sys.executable, SCRIPT, recipe, dest, *more], capture_output=True, text=True
    )


def outside(env=os.environ):
    """The environment without a path into this repository."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}


@pytest.mark.parametrize(
    "recipe",
    [
        "mnist",
        pytest.param("unet", marks=pytest.mark.slow),
        pytest.param("text", marks=pytest.mark.slow),
    ],
)
def test_a_copy_is_a_project_whose_own_tests_train_resume_predict_and_export(recipe, tmp_path):
    dest = tmp_path / "project"
    made = copy(recipe, dest, "--name", NAMES[recipe])
    assert made.returncode == 0, made.stderr
    files = {str(p.relative_to(dest)) for p in dest.rglob("*") if "common" not in p.parts}
    assert OWN_FILES[recipe] <= files
    assert {"README.md", "Makefile", "requirements.txt", f"tests/test_{NAMES[recipe]}.py"} <= files
    assert not any(f.startswith("recipes") or f.startswith(recipe) for f in files)
    carried = {p.name for p in (dest / "common").iterdir()}
    assert carried and not carried & NOT_CARRIED[recipe]
    for path in dest.rglob("*.py"):  # nothing points back here
        assert str(REPO) not in path.read_text() and "sys.path" not in path.read_text(), path

    env = outside()
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=dest, env=env, capture_output=True
    )
    assert lint.returncode == 0, lint.stdout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=dest,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-6000:]
    assert "3 passed" in tests.stdout


def test_a_copy_needs_a_new_folder_outside_the_repository_and_a_module_name(tmp_path):
    (tmp_path / "taken").mkdir()
    cases = {
        (tmp_path / "taken",): "exists: name a folder that does not",
        (REPO / "runs" / "inside",): "is inside this repository: name a folder outside it",
        (tmp_path / "new", "--name", "my-seg"): "must be a Python module name of your own",
        (tmp_path / "new", "--name", "torch"): "must be a Python module name of your own",
    }
    for args, message in cases.items():
        res = copy("unet", *args)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.splitlines() == [res.stderr.strip()] and message in res.stderr, res
    assert not (tmp_path / "new").exists() and not (REPO / "runs" / "inside").exists()
