"""Global batches by length, split among the processes (common.sampler.GlobalBucketSampler): one
sampler per simulated rank in this process; test_text.py trains with it on 2 real processes."""

import itertools
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, assert_ok, launch

from common.sampler import GlobalBucketSampler, rounded_lengths, split_evenly

BUDGET = 2000


def lengths(n, seed, longest=BUDGET // 2):
    """Document lengths on a log scale, as text has them, up to half the budget."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(4), np.log(longest), n)).astype(int).tolist()


SIZES = lengths(211, seed=0)


def ranks(processes, accumulation=1, epoch=1, sizes=SIZES, budget=BUDGET, **kwargs):
    """Each simulated rank's micro-batches of one epoch."""
    out = []
    for rank in range(processes):
        sampler = GlobalBucketSampler(
            sizes, budget, processes, rank, accumulation=accumulation, **kwargs
        )
        sampler.set_epoch(epoch)
        assert len(sampler) == len(list(sampler))
        out.append(list(sampler))
    return out


def cost(batch, sizes=SIZES):
    return len(batch) * max(sizes[i] for i in batch)


@pytest.mark.parametrize(
    "processes,accumulation,cap", [(1, 1, None), (2, 1, 8), (3, 2, 8), (4, 1, 3), (8, 1, None)]
)
def test_every_sample_once_as_many_batches_on_every_rank_within_the_budget(
    processes, accumulation, cap
):
    for seed in range(4):  # the epoch's last step takes whatever is left, others every seed
        per_rank = ranks(processes, accumulation, seed=seed, max_batch_size=cap)
        assert len({len(batches) for batches in per_rank}) == 1, "no rank waits at the end"
        assert len(per_rank[0]) % accumulation == 0
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == list(range(len(SIZES))), "every sample exactly once"
        batches = [b for batches in per_rank for b in batches]
        assert all(batch for batch in batches), "no empty batch"
        assert all(cost(b) <= BUDGET and len(b) <= (cap or len(SIZES)) for b in batches)


def test_the_batches_of_a_step_split_one_global_batch_of_similar_lengths():
    per_rank = ranks(2, accumulation=2, seed=3, max_batch_size=8)
    sampler = GlobalBucketSampler(SIZES, BUDGET, 2, 0, seed=3, accumulation=2, max_batch_size=8)
    sampler.set_epoch(1)
    for s, batch in enumerate(sampler.global_batches()):
        # micro-step j of rank r is part j * 2 + r, in the global batch's sorted order
        parts = [per_rank[r][2 * s + j] for j in range(2) for r in range(2)]
        assert [i for part in parts for i in part] == batch
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
        ordered = [SIZES[i] for i in batch]
        assert ordered == sorted(ordered)
    # Batches by length waste little on padding.
    padded = sum(cost(b) for batches in per_rank for b in batches)
    assert padded < 1.25 * sum(SIZES)


def test_the_order_is_a_function_of_seed_and_epoch():
    assert ranks(2, seed=5, epoch=1) == ranks(2, seed=5, epoch=1)
    assert ranks(2, seed=5, epoch=1) != ranks(2, seed=5, epoch=2)
    assert ranks(2, seed=5, epoch=1) != ranks(2, seed=6, epoch=1)
    # Rounded lengths tie, so the batches themselves change, not only their order.
    rounded = rounded_lengths(SIZES).tolist()
    one, two = (ranks(1, seed=5, epoch=e, sizes=rounded)[0] for e in (1, 2))
    assert {tuple(sorted(b)) for b in one} != {tuple(sorted(b)) for b in two}
    # shuffle=False: sorted by length, the same every epoch.
    plain = [ranks(1, epoch=e, shuffle=False)[0] for e in (1, 2)]
    assert plain[0] == plain[1]
    flat = [SIZES[i] for b in plain[0] for i in b]
    assert flat == sorted(flat)


def test_the_last_step_takes_what_is_left_within_the_budget():
    # Every sample of half the budget, at most 2 a batch: 9 samples on 4 ranks leave 1 over
    # after a step of 8, so the last two global batches are formed again, of 5 and 4.
    sizes = [BUDGET // 2] * 9
    per_rank = ranks(4, sizes=sizes, shuffle=False)
    assert [[len(b) for b in batches] for batches in per_rank] == [[2, 1], [1, 1], [1, 1], [1, 1]]
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(9))
    assert all(cost(b, sizes) <= BUDGET for batches in per_rank for b in batches)
    # 4 long ones and many short ones: the long ones' step keeps within the budget too.
    sizes = [10] * 37 + [BUDGET // 2] * 5
    for processes in (2, 3, 4):
        per_rank = ranks(processes, sizes=sizes, seed=1)
        assert all(cost(b, sizes) <= BUDGET for batches in per_rank for b in batches)
        assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(42))


def test_split_evenly_and_rounded_lengths():
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([1, 2], 2) == [[1], [2]]
    assert rounded_lengths([1, 8, 9, 100, 255, 4000, 8192], multiple=8).tolist() == [
        8,
        8,
        16,
        104,
        256,
        4032,
        8192,
    ]
    # Within about 3% of the length, never below it.
    values = np.arange(1, 20000)
    rounded = rounded_lengths(values, multiple=1)
    assert (rounded >= values).all() and (rounded <= values * 1.0313 + 1).all()


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="two of the longest"):
        GlobalBucketSampler([10, 600, 30], 1000)
    with pytest.raises(ValueError, match="max_batch_size must be at least 2"):
        GlobalBucketSampler([10, 20, 30], 1000, max_batch_size=1)
    with pytest.raises(ValueError, match="3 samples cannot fill the 4 micro-batches"):
        GlobalBucketSampler([10, 20, 30], 1000, num_replicas=2, accumulation=2)
    with pytest.raises(ValueError, match="rank"):
        GlobalBucketSampler(SIZES, BUDGET, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="one int per sample"):
        GlobalBucketSampler([(3, 4), (5, 6)], BUDGET)


def test_a_rank_of_fewer_batches_cannot_happen_on_any_count():
    # The property that prevents the hang of the issue, over many small data sets.
    for n, processes, seed in itertools.product((5, 17, 64), (1, 2, 3, 5), range(3)):
        if n < processes:
            continue
        per_rank = ranks(processes, sizes=lengths(n, seed), seed=seed, max_batch_size=4)
        assert len({len(b) for b in per_rank}) == 1
        assert sorted(i for b in per_rank for batch in b for i in batch) == list(range(n))


@pytest.mark.slow
def test_batch_mix_shows_batches_by_length_holding_one_class_where_length_tells_it(tmp_path):
    # Short ham, long spam: a batch by length holds one class (spread 0.5), a shuffled batch of 8
    # about the binomial spread (0.18) and one by class 4 of each (0), and both pay padding.
    rng = np.random.default_rng(0)
    for label, (low, high) in {"ham": (100, 200), "spam": (1000, 2000)}.items():
        (tmp_path / "train" / label).mkdir(parents=True)
        for i in range(64):
            (tmp_path / "train" / label / f"{i}.txt").write_bytes(b"x" * rng.integers(low, high))
    out = subprocess.run(
        [
            sys.executable,
            "scripts/studies/batch_mix.py",
            "--dataset",
            str(tmp_path),
            "--batch_size",
            "8",
            "--max_length",
            "4096",
            "--pools",
            "4",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert "128 training documents (ham 0.500, spam 0.500), cut at 4096 bytes" in out
    rows = {line[:10].strip(): line[10:].split() for line in out.splitlines()[2:]}
    assert list(rows) == ["recipe", "pool 4", "by class", "shuffled"]
    padding = {name: float(row[0].rstrip("%")) for name, row in rows.items()}
    spread = {name: float(row[1].rstrip(",")) for name, row in rows.items()}
    assert spread["recipe"] > 0.45 and spread["shuffled"] < 0.3 and spread["by class"] == 0
    assert padding["recipe"] < 10 < padding["shuffled"] and padding["by class"] > 10


@pytest.mark.slow
def test_train_batches_by_class_pads_short_ham_to_long_spam_where_the_recipe_does_not(tmp_path):
    # Short ham, long spam: the recipe's batches hold one length, so one class, and little padding;
    # by_class's hold 4 of each class (the data's shares), so a batch pads its short ham to its long
    # spam: the padding tells which batches the script trained on.
    rng = np.random.default_rng(0)
    for split, count in {"train": 32, "test": 8}.items():
        for label, (low, high) in {"ham": (100, 200), "spam": (800, 1000)}.items():
            (tmp_path / "data" / split / label).mkdir(parents=True)
            for i in range(count):
                text = bytes(rng.integers(32, 127, rng.integers(low, high)).astype(np.uint8))
                (tmp_path / "data" / split / label / f"{i}.txt").write_bytes(text)
    padding = {}
    for batches in ("recipe", "by_class"):
        res = launch(
            ["scripts/studies/train_batches.py", "--batches", batches]
            + [
                "--dataset",
                tmp_path / "data",
                "--output_dir",
                tmp_path / batches,
                "--epochs",
                1,
                "--batch_size",
                8,
            ]
            + ["--max_length", 1024, "--num_workers", 0],
            env={"OMP_NUM_THREADS": "1"},
        )
        assert_ok(res)
        assert f"batches: {batches}" in res.output
        epoch = next(line for line in res.output.splitlines() if line.startswith("epoch 1: train"))
        padding[batches] = float(epoch.split("padding ")[1].rstrip("%"))
    assert padding["recipe"] < 10 and padding["by_class"] > 40, padding
