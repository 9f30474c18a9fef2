"""MNIST's decoded images are kept in the datasets cache (common.cache.cached_tensors): a second run
reads them instead of decoding, changed data files are decoded anew, a damaged file is rewritten."""

import shutil

import pyarrow.parquet as pq
import pytest
import torch
from conftest import N_TEST, N_TRAIN, assert_ok, launch, read_metrics
from recipe_module import load_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.cache import cached_tensors
from common.data import load_splits

RECIPE = "recipes/mnist.py"


def split_file(folder, samples):
    """The cache file in `folder` of the split with this many samples."""
    for path in folder.iterdir():
        with safe_open(path, "pt") as f:
            if f.get_slice("1").get_shape() == [samples]:
                return path
    raise AssertionError(f"no cache file of {samples} samples in {folder}")


@pytest.mark.slow
def test_a_second_run_reads_the_cache_and_trains_the_same(tiny_mnist, tmp_path):
    hf_home, folder = tmp_path / "hf_home", tmp_path / "hf_home" / "datasets" / "decoded"

    def run(out, *args):
        res = launch(
            [
                RECIPE,
                "--dataset",
                tiny_mnist,
                "--output_dir",
                tmp_path / out,
                "--smoke",
                "--batch_size",
                32,
                "--eval_batch_size",
                256,
                *args,
            ],
            launcher="python",
            env={"HF_HOME": str(hf_home)},
        )
        assert_ok(res)
        return read_metrics(tmp_path / out)[0], tmp_path / out / "model.safetensors"

    first, weights = run("first")
    assert len(list(folder.iterdir())) == 2  # the train and the test split
    # Shift the test split's labels in its file: what the next run evaluates on shows where it
    # read them from.
    test_file = split_file(folder, N_TEST)
    with safe_open(test_file, "pt") as f:
        metadata, images, labels = f.metadata(), f.get_tensor("0"), f.get_tensor("1")
    save_file({"0": images, "1": (labels + 1) % 10}, test_file, metadata)
    written = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    second, second_weights = run("second")
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
    assert f"warning: cannot read cache file {path} (" in capsys.readouterr().err
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
