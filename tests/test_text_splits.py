"""scripts/studies/text_splits.py, whose 5 splits docs/text.md holds the text recipe and the
TF-IDF baselines to: each document is held out once, and every split is measured."""

import numpy as np
import pytest
from conftest import assert_ok, launch


@pytest.mark.slow
def test_each_document_is_held_out_in_exactly_one_split(tmp_path):
    rng = np.random.default_rng(0)
    words = {"ham": [b"meeting", b"lunch", b"report"], "spam": [b"prize", b"money", b"click"]}
    names = set()
    for label, own in words.items():
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(24):
            text = b" ".join(rng.choice(own + [b"the", b"and", b"to"], int(rng.integers(5, 40))))
            (tmp_path / "data" / label / f"{i}.txt").write_bytes(text + b" %d" % i)
            names.add(f"{label}/{i}.txt")
    work = tmp_path / "work"
    res = launch(
        ["scripts/studies/text_splits.py", "--dataset", tmp_path / "data", "--workdir", work]
        + ["--folds", 3, "--", "--epochs", 1, "--max_length", 256, "--global_batch_size", 8],
        env={"OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert_ok(res)
    lines = [line for line in res.output.splitlines() if line.startswith(("split ", "mean: "))]
    assert [line.split(":")[0] for line in lines] == ["split 0", "split 1", "split 2", "mean"]
    assert all("recipe " in line and "tfidf_linear_svm " in line for line in lines)
    held = []
    for i in range(3):
        test = {
            p.relative_to(work / f"split{i}" / "test").as_posix()
            for p in (work / f"split{i}" / "test").glob("*/*")
        }
        train = {
            p.relative_to(work / f"split{i}" / "train").as_posix()
            for p in (work / f"split{i}" / "train").glob("*/*")
        }
        assert test | train == names and not test & train
        held += sorted(test)
    assert sorted(held) == sorted(names), "each document held out once"
    assert (work / "run0" / "model.safetensors").exists()
