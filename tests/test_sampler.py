"""The bucketing batch sampler and the order of a global batch (common/sampler.py).

Most tests build one BucketBatchSampler per simulated rank in this process; the last one
launches tests/bucket_probe.py on 1 and 2 real processes (gloo DDP on the CPU). GlobalBatchOrder
is dealt out here as prepare() deals it; test_global_batch.py launches it."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import assert_ok, launch

from common.sampler import BucketBatchSampler, GlobalBatchOrder

BUDGET = 4096
# (64, 80) costs 5120 > BUDGET: such a sample must make a batch of its own.
SHAPES = [(8, 8), (8, 16), (16, 8), (16, 16), (24, 32), (32, 32), (64, 80)]


def mixed_sizes(n, seed):
    rng = np.random.default_rng(seed)
    return [SHAPES[k] for k in rng.integers(0, len(SHAPES), n)]


SIZES = mixed_sizes(211, seed=0)  # 59 batches: a remainder on 2 and on 3 ranks


def ranks(num_replicas, epoch=1, sizes=SIZES, **kwargs):
    """One sampler per rank, as each process would build it; returns each rank's batches."""
    out = []
    for rank in range(num_replicas):
        sampler = BucketBatchSampler(sizes, BUDGET, num_replicas, rank, **kwargs)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def all_batches(sizes=SIZES, **kwargs):
    """Every batch of epoch 1, before sharding."""
    sampler = BucketBatchSampler(sizes, BUDGET, **kwargs)
    sampler.set_epoch(1)
    return sampler.epoch_batches()


def flat(batches):
    return [i for batch in batches for i in batch]


def cost(batch, sizes=SIZES):
    return len(batch) * max(sizes[i][0] for i in batch) * max(sizes[i][1] for i in batch)


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_training_shards_cover_everything_with_equal_batch_counts(num_replicas):
    per_rank = ranks(num_replicas, seed=5)
    batches = all_batches(seed=5)
    assert len(batches) % 3 == 2, (
        "pick data whose batch count leaves a remainder, so padding is exercised"
    )
    assert len({len(b) for b in per_rank}) == 1, "every rank must get the same number of batches"
    seen = Counter(flat(itertools.chain(*per_rank)))
    assert set(seen) == set(range(len(SIZES)))
    # Only the samples of the first few batches of the epoch may repeat, each once more.
    padding = (num_replicas - len(batches) % num_replicas) % num_replicas
    assert Counter(i for i, c in seen.items() if c > 1) == Counter(flat(batches[:padding]))
    assert max(seen.values()) <= 2


def test_drop_last_gives_equal_counts_without_repeats():
    per_rank = ranks(2, seed=5, drop_last=True)
    batches = all_batches(seed=5)
    assert len(per_rank[0]) == len(per_rank[1]) == len(batches) // 2
    seen = flat(itertools.chain(*per_rank))
    assert len(seen) == len(set(seen))
    assert set(range(len(SIZES))) - set(seen) == set(batches[-1]), (
        "only the last batch of the epoch is dropped"
    )


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_evaluation_mode_counts_every_sample_exactly_once(num_replicas):
    per_rank = ranks(num_replicas, shuffle=False, even_batches=False)
    assert sorted(flat(itertools.chain(*per_rank))) == list(range(len(SIZES)))
    counts = [len(b) for b in per_rank]
    assert max(counts) - min(counts) <= 1
    if num_replicas > 1:
        assert max(counts) > min(counts), "pick data whose batch count leaves a remainder"


def test_the_budget_is_respected_and_big_samples_make_small_batches():
    assert all(len(b) == 1 or cost(b) <= BUDGET for b in all_batches())
    batches = all_batches(max_batch_size=6)
    assert all(len(b) == 1 or cost(b) <= BUDGET for b in batches)
    assert max(len(b) for b in batches) == 6
    over = [i for i, (h, w) in enumerate(SIZES) if h * w > BUDGET]
    assert over and all([i] in batches for i in over), "an over-budget sample forms its own batch"
    small = [b for b in batches if all(SIZES[i] == (8, 8) for i in b)]
    assert small and max(len(b) for b in small) == 6, (
        "small samples fill batches up to max_batch_size"
    )
    # Similar sizes are grouped: padding wastes little.
    pixels = sum(h * w for h, w in SIZES)
    assert sum(cost(b) for b in batches) < 1.1 * pixels


def test_ints_are_costs():
    sizes = [5, 50, 7, 100, 3, 60, 1000]
    sampler = BucketBatchSampler(sizes, 120)
    batches = list(sampler)
    assert sorted(flat(batches)) == list(range(len(sizes)))
    assert all(len(b) == 1 or len(b) * max(sizes[i] for i in b) <= 120 for b in batches)
    assert [6] in batches


def test_order_changes_every_epoch_and_repeats_for_the_same_seed():
    epoch1, epoch2 = ranks(2, epoch=1, seed=7), ranks(2, epoch=2, seed=7)
    assert epoch1[0] != epoch2[0] and epoch1[1] != epoch2[1]
    assert ranks(2, epoch=1, seed=7) == epoch1
    assert ranks(2, epoch=1, seed=8) != epoch1
    # Batches are shuffled, not served smallest samples first.
    largest = [max(SIZES[i]) for batch in epoch1[0] for i in batch]
    assert largest != sorted(largest)
    # Samples of one size are grouped differently in each epoch, not only reordered.
    assert {tuple(sorted(b)) for b in epoch1[0] + epoch1[1]} != {
        tuple(sorted(b)) for b in epoch2[0] + epoch2[1]
    }


@pytest.mark.parametrize(
    "kwargs", [{}, {"drop_last": True}, {"shuffle": False, "even_batches": False}]
)
def test_len_is_the_number_of_batches_of_this_rank(kwargs):
    for rank in range(3):
        sampler = BucketBatchSampler(SIZES, BUDGET, 3, rank, **kwargs)
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            assert len(sampler) == len(list(sampler))


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="rank"):
        BucketBatchSampler(SIZES, BUDGET, num_replicas=2, rank=2)
    for sizes in ([], [(3, 4, 5)], [(3, 4), (0, 2)], [2.5]):
        with pytest.raises(ValueError, match="sizes"):
            BucketBatchSampler(sizes, BUDGET)


def optimizer_steps(order, batch, processes):
    """The samples of each optimizer step when prepare() deals the batches of
    DataLoader(sampler=order, batch_size=batch) to `processes` ranks (BatchSamplerShard), each
    accumulating until global_batch: read batch by batch of a step, rank by rank."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    ranks = [
        list(BatchSamplerShard(BatchSampler(order, batch, drop_last=False), processes, rank))
        for rank in range(processes)
    ]
    assert len({len(batches) for batches in ranks}) == 1, "as many batches on every rank"
    steps = order.global_batch // (batch * processes)
    return [
        [i for j in range(steps) for batches in ranks for i in batches[s * steps + j]]
        for s in range(len(ranks[0]) // steps)
    ]


@pytest.mark.parametrize("sizes", [None, SIZES], ids=["shuffled", "bucketed"])
def test_a_global_batch_holds_the_same_samples_on_any_process_count(sizes):
    # 211 samples, global batches of 24: 8 an epoch, 19 samples left out (others every epoch).
    order = GlobalBatchOrder(len(SIZES), 24, seed=5, sizes=sizes)
    epochs = {}
    for epoch in (1, 2):
        order.set_epoch(epoch)
        samples = list(order)
        assert len(samples) == len(set(samples)) == 8 * 24
        epochs[epoch] = [samples[s * 24 : (s + 1) * 24] for s in range(8)]
        for processes, batch in ((1, 24), (1, 8), (2, 12), (2, 3), (3, 8), (4, 2)):
            assert optimizer_steps(order, batch, processes) == epochs[epoch], (processes, batch)
    assert set(flat(epochs[1])) != set(flat(epochs[2])), "other samples left out every epoch"
    again = GlobalBatchOrder(len(SIZES), 24, seed=5, sizes=sizes)
    again.set_epoch(2)
    assert list(again) == flat(epochs[2])
    if sizes is not None:  # each global batch is a run of the epoch's samples sorted by size
        areas = [sorted(SIZES[i][0] * SIZES[i][1] for i in batch) for batch in epochs[1]]
        areas.sort(key=lambda a: (a[0], a[-1]))
        assert all(a[-1] <= b[0] for a, b in itertools.pairwise(areas))


@pytest.mark.slow
def test_bucket_loader_on_real_processes(tmp_path):
    """Train two epochs, replay, resume mid-epoch, and evaluate exactly, through bucket_loader, on
    2 processes (1 replica: the tests above)."""
    nproc = 2
    train, test = mixed_sizes(91, seed=1), mixed_sizes(41, seed=2)
    spec = tmp_path / "sizes.json"
    spec.write_text(json.dumps({"train": train, "test": test, "budget": BUDGET}))
    res = launch(
        ["tests/bucket_probe.py", spec],
        nproc=nproc,
        env={"PROBE_OUT": str(tmp_path)},
        timeout=180,
    )
    assert_ok(res)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]

    for rank, report in enumerate(seen):
        for epoch in (1, 2):
            # Exactly this rank's shard of the sampler: prepare_data_loader did not shard it again.
            sampler = BucketBatchSampler(train, BUDGET, nproc, rank, seed=3)
            sampler.set_epoch(epoch)
            assert report["train"][str(epoch)] == list(sampler)
            assert len(report["train"][str(epoch)]) == report["len"] == seen[0]["len"]
        assert report["train"]["1"] != report["train"]["2"], "the order must change every epoch"
        assert report["replay_epoch1"] == report["train"]["1"]
        assert report["resumed_epoch2"] == report["train"]["2"][2:]
        assert all(n == 1 or n * h * w <= BUDGET for n, _, h, w in report["shapes"])
        assert report["eval_samples"] == len(test) and report["eval_id_sum"] == sum(
            range(len(test))
        )
        assert report["world_size"] == nproc
        assert report["device"].startswith("cuda" if torch.cuda.is_available() else "cpu"), (
            "batches on the device"
        )
    for epoch in ("1", "2"):
        ids = flat(itertools.chain(*(r["train"][epoch] for r in seen)))
        assert set(ids) == set(range(len(train)))
        assert all(r["global_samples"][epoch] == len(ids) for r in seen)
    evaluated = flat(itertools.chain(*(r["eval"] for r in seen)))
    assert sorted(evaluated) == list(range(len(test))), "every test sample evaluated exactly once"
    if nproc == 2:
        assert len(all_batches(train, seed=3)) % 2 == 1, "the training batches must need padding"
        assert seen[0]["eval_len"] != seen[1]["eval_len"], (
            "the ranks must hold different eval batch counts"
        )
