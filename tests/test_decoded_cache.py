"""MNIST's decoded images are kept in the datasets cache (common.cache.cached_tensors): a second run
reads them instead of decoding; edited decoding code and changed data files are decoded anew; a
damaged file is rewritten."""

import contextlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import N_TEST, N_TRAIN, REPO, assert_ok, launch, read_metrics
from recipe_module import load_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.cache import cached_tensors, code_fingerprint, code_reached
from common.data import load_splits

RECIPE = "recipes/mnist.py"


def split_file(folder, samples):
    """The cache file in `folder` of the split with this many samples (other caches there, such
    as the U-Net's mask scans, are not safetensors files)."""
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            if f.get_slice("1").get_shape() == [samples]:
                return path
    raise AssertionError(f"no cache file of {samples} samples in {folder}")


@contextlib.contextmanager
def recipe_copy():
    """A copy of recipes/mnist.py beside it, as a user makes one, removed afterwards."""
    copy = REPO / "recipes" / f"my_recipe_{uuid.uuid4().hex[:8]}.py"
    copy.write_text((REPO / RECIPE).read_text())
    try:
        yield copy
    finally:
        copy.unlink()


def edit(copy, old, new):
    """Replace the one occurrence of `old` in the copy, as a user edits it."""
    source = copy.read_text()
    assert source.count(old) == 1
    copy.write_text(source.replace(old, new))


def test_a_copy_whose_decoding_is_edited_decodes_again(mnist_run, tiny_mnist, tmp_path):
    # mnist_run decoded tiny_mnist's splits into this session's datasets cache (HF_HOME: conftest),
    # where a copy edited elsewhere reads them (test_a_copy_edited_outside_the_decoding_...).
    folder = Path(os.environ["HF_HOME"]) / "datasets" / "decoded"
    assert split_file(folder, N_TRAIN) and split_file(folder, N_TEST)
    with recipe_copy() as copy:
        raising = '    def decode():\n        raise DataError("the edited decode() ran")\n'
        edit(copy, "    def decode():\n", raising)
        args = [copy, "--dataset", tiny_mnist, "--output_dir", tmp_path / "out", "--smoke"]
        res = launch(args, launcher="python")
    assert res.returncode == 2 and "error: the edited decode() ran" in res.output, res


@pytest.mark.slow
def test_a_copy_edited_outside_the_decoding_reads_the_cache_and_trains_the_same(
    tiny_mnist, tmp_path
):
    hf_home, folder = tmp_path / "hf_home", tmp_path / "hf_home" / "datasets" / "decoded"

    def run(recipe, out):
        res = launch(
            [
                recipe,
                "--dataset",
                tiny_mnist,
                "--output_dir",
                tmp_path / out,
                "--smoke",
                "--batch_size",
                32,
                "--eval_batch_size",
                256,
            ],
            launcher="python",
            env={"HF_HOME": str(hf_home)},
        )
        assert_ok(res)
        return read_metrics(tmp_path / out)[0], tmp_path / out / "model.safetensors"

    first, weights = run(RECIPE, "first")
    assert len(list(folder.iterdir())) == 2  # the train and the test split
    # Shift the test split's labels in its file: what the next run evaluates on shows where it
    # read them from.
    test_file = split_file(folder, N_TEST)
    with safe_open(test_file, "pt") as f:
        metadata, images, labels = f.metadata(), f.get_tensor("0"), f.get_tensor("1")
    save_file({"0": images, "1": (labels + 1) % 10}, test_file, metadata)
    written = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    # The next run is a copy (another name) whose code differs outside the decoding only.
    with recipe_copy() as copy:
        edit(copy, 'f"test accuracy {result', 'f"accuracy on the test split {result')
        second, second_weights = run(copy, "second")
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == written  # read, not written again
    assert second["accuracy"] != first["accuracy"] and second["eval_samples"] == N_TEST
    # The same training as from the decoded images: the same loss and weights, bit for bit.
    assert second["train_loss"] == first["train_loss"]
    a, b = load_file(weights), load_file(second_weights)
    assert all(torch.equal(a[k], b[k]) for k in a)


class Decoder:
    """A make() for cached_tensors that counts its calls: the labels of a split as a tensor."""

    def __init__(self, split):
        self.split, self.calls = split, 0

    def __call__(self):
        self.calls += 1
        return torch.arange(len(self.split)), torch.tensor(self.split["label"])


def test_changed_data_files_are_decoded_anew(tiny_mnist, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data = shutil.copytree(tiny_mnist, tmp_path / "data")
    train = load_splits(str(data), ["train"], ["label"])["train"]
    decoder = Decoder(train)
    x, y = cached_tensors([train._fingerprint, "label"], decoder)
    assert decoder.calls == 1 and len(y) == N_TRAIN
    again = cached_tensors([train._fingerprint, "label"], decoder)
    assert torch.equal(again[1], y) and decoder.calls == 1  # read
    cached_tensors([train._fingerprint, "other", "columns"], decoder)  # another key: made again
    assert decoder.calls == 2
    pq.write_table(pq.read_table(data / "train.parquet").slice(0, 200), data / "train.parquet")
    changed = load_splits(str(data), ["train"], ["label"])["train"]
    decoder = Decoder(changed)
    assert len(cached_tensors([changed._fingerprint, "label"], decoder)[1]) == 200
    assert decoder.calls == 1
    assert len(list((tmp_path / "cache" / "decoded").iterdir())) == 3  # and no temporary file left


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_a_damaged_cache_file_is_made_again_and_rewritten(
    damage, tiny_mnist, tmp_path, monkeypatch, capsys
):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train = load_splits(str(tiny_mnist), ["train"], ["label"])["train"]
    decoder = Decoder(train)
    key = [train._fingerprint, "label"]
    x, y = cached_tensors(key, decoder)
    (path,) = (tmp_path / "cache" / "decoded").iterdir()
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2] if damage == "truncate" else b"")
    again = cached_tensors(key, decoder)
    assert decoder.calls == 2 and torch.equal(again[0], x) and torch.equal(again[1], y)
    (line,) = capsys.readouterr().err.splitlines()  # one line
    assert line.startswith(f"warning: cannot read cache file {path} (")
    assert line.endswith("): writing it again")
    assert path.stat().st_size == size  # whole again: the next call reads it
    assert torch.equal(cached_tensors(key, decoder)[1], y) and decoder.calls == 2


def test_cache_decoded_false_writes_no_file(tiny_mnist, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    mnist = load_recipe("mnist")
    train_loader, _ = mnist.make_loaders(mnist.Config(dataset=str(tiny_mnist), cache_decoded=False))
    assert len(train_loader.dataset) == N_TRAIN and not (tmp_path / "cache" / "decoded").exists()
    mnist.make_loaders(mnist.Config(dataset=str(tiny_mnist)))
    assert len(list((tmp_path / "cache" / "decoded").iterdir())) == 2


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_warns_and_runs_on(tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "decoded").write_text("a file where the folder would be")
    (x,) = cached_tensors(["any"], lambda: (torch.arange(5, dtype=torch.uint8),))
    assert torch.equal(x, torch.arange(5, dtype=torch.uint8))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: cannot write cache file ")
    assert line.endswith("): decoding again next run")
    assert list((tmp_path / "cache").iterdir()) == [tmp_path / "cache" / "decoded"]


# ---- the code in the key: what the fingerprint follows ----

HELPERS = """
import json
from os.path import join

import numpy as np


class Base:
    def scale(self):
        return 2


class Scaler(Base):
    @property
    def factor(self):
        return twice(self.scale())


def twice(x):
    return x * 2


def make():
    return np.asarray([json.dumps(join("a", "b")), Scaler().factor])


def unused():
    return 0
"""


def import_file(path, text, monkeypatch):
    """`text` written to `path` and imported as a module of its own, as a recipe copy is."""
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"helpers_{uuid.uuid4().hex[:8]}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # where inspect finds a class's file
    spec.loader.exec_module(module)
    return module


def test_the_code_fingerprint_follows_project_helpers_by_global_name(tmp_path, monkeypatch):
    helpers = import_file(tmp_path / "a.py", HELPERS, monkeypatch)
    # The property's helper, the class's base; not json, os.path (frozen), numpy or `unused`.
    reached = {obj.__qualname__ for obj in code_reached([helpers.make])}
    assert reached == {"make", "Scaler", "Base", "twice"}
    fingerprint = code_fingerprint([helpers.make])
    same = import_file(tmp_path / "b.py", HELPERS.replace("return 0", "return 1"), monkeypatch)
    assert code_fingerprint([same.make]) == fingerprint  # `unused` edited: the same code
    for old, new in (("x * 2", "x * 3"), ("return 2", "return 3")):  # twice(), Base.scale()
        edited = import_file(tmp_path / "c.py", HELPERS.replace(old, new), monkeypatch)
        assert code_fingerprint([edited.make]) != fingerprint, new


class Zeros:
    """A make() for cached_tensors that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return (torch.zeros(3),)


def first_reader(path):
    return path.read_bytes()


def second_reader(path):
    return path.read_bytes()[::-1]


def test_functions_passed_as_code_are_part_of_the_key(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    make = Zeros()  # its code names no reader: make() would receive one as a value
    cached_tensors(["files"], make, code=[first_reader])
    cached_tensors(["files"], make, code=[first_reader])  # read
    assert make.calls == 1
    cached_tensors(["files"], make, code=[second_reader])  # other code: made again
    assert make.calls == 2


def test_mnist_decoding_reaches_its_helpers_in_common_and_the_recipe(tiny_mnist, monkeypatch):
    mnist = load_recipe("mnist")
    makes = []
    monkeypatch.setattr(
        mnist, "cached_tensors", lambda key, make, **_: makes.append(make) or make()
    )
    split = load_splits(str(tiny_mnist), ["test"], ["image", "label"])["test"]
    mnist.to_tensors(
        split, mnist.Config(dataset=str(tiny_mnist)), "test", "cpu", list("0123456789")
    )
    reached = code_reached(makes)
    names = {obj.__qualname__ for obj in reached}
    # decode(), the function that defines it, and what they call in common/data.py.
    for name in ("to_tensors.<locals>.decode", "to_tensors", "decode_images", "class_labels"):
        assert name in names
    assert {"unreadable_image", "DataError", "UserError", "TensorBatches"} <= names
    assert all(Path(inspect.getfile(obj)).is_relative_to(REPO) for obj in reached)  # no packages


MADE = 'def pick(x):\n    return x in {"red", "green", "blue", "cyan", "magenta"}\n'
PRINT_FINGERPRINTS = """
import sys
sys.path[:0] = [sys.argv[1], "."]
import a
from common.cache import code_fingerprint
namespace = {}
exec(compile(sys.argv[2], "<made>", "exec"), namespace)
print(code_fingerprint([a.make]), code_fingerprint([namespace["pick"]]))
"""


def test_the_code_fingerprint_is_the_same_in_every_process(tmp_path, monkeypatch):
    """Source text, and for code without a source file (made by exec) its bytecode and constants
    (a set's order changes with the hash seed): the same in the test and in fresh processes."""
    helpers = import_file(tmp_path / "a.py", HELPERS, monkeypatch)
    namespace = {}
    exec(compile(MADE, "<made>", "exec"), namespace)
    here = [code_fingerprint([helpers.make]), code_fingerprint([namespace["pick"]])]
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", PRINT_FINGERPRINTS, str(tmp_path), MADE],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.split() == here
    exec(compile(MADE.replace("cyan", "teal"), "<made>", "exec"), namespace)  # edited
    assert code_fingerprint([namespace["pick"]]) != here[1]


def test_the_unet_decoding_key_reaches_the_data_surface_a_copy_edits(shapes, monkeypatch):
    # An edit to how a pair is read (unet_data.py) or decoded (common/segmentation/data.py)
    # decodes again: the code that the U-Net's decoded() hands to the cache reaches both.
    from common.segmentation import data as segmentation_data
    from common.segmentation.pairs import folder_pairs
    from unet_data import Pairs

    passed = {}

    def spy(key, make, *, code=(), enabled=True):
        passed.update(key=key, code=code)
        return make()

    monkeypatch.setattr(segmentation_data, "cached_tensors", spy)
    pairs = Pairs(folder_pairs(shapes / "imgs", shapes / "masks")[:2])
    classes = segmentation_data.MaskClasses((0, 85, 170, 255))
    segmentation_data.decoded(
        pairs,
        classes,
        "RGB",
        [(48, 48)] * len(pairs),
        fixed=True,
        threads=1,
        device="cpu",
        cache_decoded=True,
    )
    reached = {obj.__qualname__ for obj in code_reached(passed["code"])}
    expected = {"Pairs.__getitem__", "read_pair", "open_image", "decode_pair", "MaskClasses"}
    assert expected | {"mask_codes", "nearest"} <= reached, reached
    assert passed["key"][1] == pairs.identity()  # the files' paths, sizes and times of change
