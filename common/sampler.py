"""Batches of similar-size samples under a pixel budget, sharded across processes; and the order
of a global batch that stays the same on any number of processes (GlobalBatchOrder); and global
batches of similar lengths under a token budget, split among the processes (GlobalBucketSampler).

    sizes = [(h, w) for each sample]        # or one int cost per sample
    train_loader = bucket_loader(train_set, sizes, cfg.max_batch_pixels, accelerator, train=True,
                                 seed=cfg.seed, collate_fn=pad_collate)
    for epoch in ...:
        train_loader.set_epoch(epoch)       # as for a prepared loader
        # resume with accelerator.skip_first_batches(train_loader, batches_done)
        ...

Do not pass these loaders to accelerator.prepare(): it wraps any batch sampler in
BatchSamplerShard, which deals the batches out to the ranks again (a sharded sampler loses half
its data on each rank) and never forwards loader.set_epoch() to it (the order never changes).
So BucketBatchSampler shards itself, and bucket_loader() wraps the DataLoader with Accelerate's
prepare_data_loader(num_processes=1): device placement, the end-of-epoch signal for gradient
accumulation, set_epoch and skip_first_batches, and no second sharding.

Exact evaluation: `bucket_loader(..., train=False)` gives every sample to exactly one rank
with no padding, so ranks may get different numbers of batches. The evaluation loop must then
do no collective per batch: run the unwrapped model (a DDP model may broadcast its buffers in
forward; keep_torch_compile=False, or Accelerate 1.15 re-points a compiled model at the bare
one and DDP drops out of training), add up sums and counts locally, and reduce them once after
the loop:

    net = accelerator.unwrap_model(model, keep_torch_compile=False).eval()
    # loss sum, correct predictions, samples
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    for x, y in test_loader:
        logits = net(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    loss_sum, correct, samples = accelerator.reduce(totals, "sum").tolist()  # samples: exact
"""

import numpy as np
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Sampler

from common.signals import ignore_stop_signals


class _EpochBatches(Sampler):
    """A batch sampler whose batches are worked out once an epoch (rank_batches(), for
    set_epoch()'s epoch) and kept until the epoch changes: len() and iteration read them."""

    epoch, _cache = 0, None  # (epoch, this rank's batches)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([list(batch) for batch in self._batches()])

    def __len__(self):
        return len(self._batches())

    def _batches(self):
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self.rank_batches())
        return self._cache[1]


class BucketBatchSampler(_EpochBatches):
    """Yields lists of dataset indices: batches of similar-size samples whose padded cost fits
    `max_batch_pixels`, for one rank of `num_replicas`.

    sizes: one (height, width) per sample, or one int per sample taken as its cost.
        A batch of (h, w) samples costs len(batch) * max(h) * max(w) (every sample padded to
        the batch's largest height and width); a batch of ints costs len(batch) * max(size).
        A single sample that alone costs more than the budget forms a batch of its own.
    max_batch_size: also at most this many samples per batch (None: no limit).

    Batches are formed by sorting the samples by (area, height), ties in a random order,
    and filling each batch greedily. Samples of the same size are therefore grouped
    differently every epoch; when every size is unique the groups repeat and only their order
    changes, so pass sizes rounded to a few values (e.g. multiples of 32) to mix more. The
    number of batches depends on the sizes alone: it is the same in every epoch.

    The contract across ranks, for every epoch:
    - the order is a pure function of (seed, epoch), the same on every rank: the batches are
      shuffled with a generator seeded from (seed, epoch) and dealt round-robin, batch i of
      the epoch to rank i % num_replicas. `set_epoch(epoch)` reshuffles, as for
      DistributedSampler (shuffle=False: sorted by size, the same every epoch).
    - each sample goes to exactly one rank, and `len(sampler)` is the number of batches this
      rank yields. What happens when the batch count B is not a multiple of num_replicas:
      - even_batches=True (training, the default): every rank gets the same number of batches,
        ceil(B / num_replicas), so no rank waits forever in a collective. The first
        num_replicas - B % num_replicas batches of this epoch's order are repeated at the end
        to fill up; only their samples are seen twice (at most num_replicas - 1 batches; with
        fewer batches than ranks the batches cycle).
      - drop_last=True: the last B % num_replicas batches of this epoch's order are dropped
        (different ones every epoch); equal counts and no repeats.
      - even_batches=False (exact evaluation): no sample repeats and none is dropped; ranks
        get B // num_replicas or one batch more. Do no per-batch collective with it.
    - to resume mid-epoch, call set_epoch(epoch) and skip the batches already done:
      `accelerator.skip_first_batches(loader, batches_done)` on a bucket_loader, or
      `itertools.islice(sampler, batches_done, None)`.
    """

    def __init__(
        self,
        sizes,
        max_batch_pixels,
        num_replicas=1,
        rank=0,
        seed=0,
        shuffle=True,
        drop_last=False,
        max_batch_size=None,
        even_batches=True,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if max_batch_pixels <= 0 or (max_batch_size is not None and max_batch_size < 1):
            raise ValueError("max_batch_pixels and max_batch_size must be positive")
        self.heights, self.widths = _parse_sizes(sizes)
        self.max_batch_pixels, self.max_batch_size = max_batch_pixels, max_batch_size
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.shuffle, self.drop_last, self.even_batches = shuffle, drop_last, even_batches

    def rank_batches(self):
        """This rank's batches of the current epoch."""
        return self._shard(self.epoch_batches())

    def epoch_batches(self):
        """Every batch of the current epoch, for all ranks, before sharding."""
        rng = np.random.default_rng((self.seed, self.epoch))
        n = len(self.heights)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        area = self.heights * self.widths
        order = order[np.lexsort((self.heights[order], area[order]))]  # stable: ties stay shuffled
        heights, widths = self.heights.tolist(), self.widths.tolist()
        batches, batch, max_h, max_w = [], [], 0, 0
        for i in order.tolist():
            h, w = max(max_h, heights[i]), max(max_w, widths[i])
            full = (
                len(batch) == self.max_batch_size
                or (len(batch) + 1) * h * w > self.max_batch_pixels
            )
            if batch and full:
                batches.append(batch)
                batch, h, w = [], heights[i], widths[i]
            batch.append(i)
            max_h, max_w = h, w
        batches.append(batch)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    def _shard(self, batches):
        extra = len(batches) % self.num_replicas
        if extra and self.drop_last:
            batches = batches[: len(batches) - extra]
        elif extra and self.even_batches:
            batches = batches + [
                batches[j % len(batches)] for j in range(self.num_replicas - extra)
            ]
        return batches[self.rank :: self.num_replicas]


class GlobalBatchOrder(Sampler):
    """The training samples of an epoch in the order of a sequence of global batches of
    `global_batch` samples that is the same on any number of processes, for a DataLoader of
    micro-batches that accelerator.prepare() deals out.

    Every epoch: a permutation of the samples seeded by (seed, epoch), less its last
    len(data) % global_batch samples (different ones every epoch), so that every optimizer step
    has global_batch samples; global batch s is the permutation's samples [s*B, (s+1)*B). With
    `sizes` (as for BucketBatchSampler), the kept samples are sorted by size first (ties stay
    in the random order) and the global batches shuffled: each holds samples of similar size.

    How the processes share it: a DataLoader(dataset, sampler=this, batch_size=m) cuts the order
    into micro-batches of m, and prepare() deals micro-batch k to rank k % P. With accumulation
    steps a = B / (P * m), the a batches of each rank's optimizer step are then micro-batches
    s*a*P .. (s+1)*a*P - 1: global batch s, whatever P, m and a are. Read in the order (micro-step,
    rank), they are its samples in their order. Nothing is repeated to even out the ranks: every
    rank gets (len // B) * a micro-batches.
    """

    def __init__(self, n, global_batch, seed=0, sizes=None):
        if not 1 <= global_batch <= n:
            raise ValueError(f"global_batch must be 1 to {n} (the samples), got {global_batch}")
        self.n, self.global_batch, self.seed, self.epoch = n, global_batch, seed, 0
        self.sizes = None if sizes is None else _parse_sizes(sizes)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n // self.global_batch * self.global_batch

    def __iter__(self):
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(self.n)[: len(self)]
        if self.sizes is not None:
            heights, widths = self.sizes
            area = heights * widths
            order = order[np.lexsort((heights[order], area[order]))]  # stable: ties stay shuffled
            batches = order.reshape(-1, self.global_batch)
            order = batches[rng.permutation(len(batches))].reshape(-1)
        return iter(order.tolist())


def _parse_sizes(sizes):
    """(heights, widths) as int64 arrays; an int size s is read as height s, width 1."""
    if len(sizes) == 0:
        raise ValueError("sizes is empty: give one size per sample")
    try:
        pairs = np.asarray([(s, 1) if np.ndim(s) == 0 else tuple(s) for s in sizes])
    except ValueError:  # a mix of pairs and longer shapes
        pairs = np.zeros(0)
    if (
        pairs.ndim != 2
        or pairs.shape[1] != 2
        or not np.issubdtype(pairs.dtype, np.integer)
        or (pairs <= 0).any()
    ):
        raise ValueError(
            f"sizes must hold one positive int or (height, width) pair of ints per sample, "
            f"got {sizes[0]!r} first"
        )
    return pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)


def bucket_loader(
    dataset,
    sizes,
    max_batch_pixels,
    accelerator,
    train,
    seed=0,
    max_batch_size=None,
    collate_fn=None,
    num_workers=0,
    pin_memory=None,
):
    """A DataLoader of this rank's bucketed batches, on the accelerator's device.

    train=True: reshuffled every epoch (call `loader.set_epoch(epoch)`), the same number of
    batches on every rank (a few batches repeat, see BucketBatchSampler).
    train=False: in size order, every sample on exactly one rank once; ranks may differ by one
    batch, so reduce the results once after the loop (see the module docstring).
    `collate_fn` must pad the samples of a batch to a common size.
    pin_memory: None pins on a GPU; pass False for a dataset whose batches are on the GPU already.
    """
    sampler = BucketBatchSampler(
        sizes,
        max_batch_pixels,
        accelerator.num_processes,
        accelerator.process_index,
        seed=seed,
        shuffle=train,
        max_batch_size=max_batch_size,
        even_batches=train,
    )
    return sharded_loader(
        dataset, sampler, accelerator, collate_fn, num_workers, seed=seed, pin_memory=pin_memory
    )


class GlobalBucketSampler(_EpochBatches):
    """Yields lists of dataset indices: one rank's micro-batches of global batches of
    similar-size samples (documents by length), each micro-batch at most `max_batch_tokens`
    padded tokens. A global batch is one optimizer step of every process, num_replicas x
    accumulation micro-batches: it is formed first, from the epoch's samples sorted by size,
    then split. So, on any number of processes:

    - every sample is in exactly one micro-batch of one rank per epoch: none repeats to fill up
      a rank, none is left out;
    - every rank gets the same number of batches, (global batches) x accumulation: no rank waits
      forever at the end of an epoch;
    - the micro-batches of a step hold samples of the same sizes, so no rank waits for another
      that drew the long ones (bucketing each rank's shard on its own would).

    sizes: one int per sample, its length in tokens. A micro-batch of n samples costs n x the
        longest (every sample padded to it). The micro-batches of a global batch of m samples
        hold m // S or one more, S = num_replicas x accumulation, in their sorted order (the
        fuller ones the shorter samples); the global batch is filled while that count times its
        longest sample fits the budget, and at most max_batch_size per micro-batch.
    max_batch_tokens: at least twice the longest sample, and max_batch_size (None: no limit)
        at least 2, so that the epoch's last step can take the samples left over: when fewer
        than S are left, the last two global batches are formed again from their samples.

    The order is a pure function of (seed, epoch), the same on every rank: the samples are
    shuffled, sorted by size (ties stay shuffled: round the sizes, e.g. with rounded_lengths, so
    that batches mix differently every epoch), cut into global batches, and the global batches
    shuffled. `set_epoch(epoch)` reshuffles; shuffle=False keeps the sorted order. The global
    batches depend on num_replicas and accumulation: a mid-epoch resume skips this rank's
    batches done (`accelerator.skip_first_batches`) with the same process count.
    """

    def __init__(
        self,
        sizes,
        max_batch_tokens,
        num_replicas=1,
        rank=0,
        seed=0,
        shuffle=True,
        accumulation=1,
        max_batch_size=None,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.sizes, _ = _parse_sizes(sizes)
        if any(np.ndim(s) for s in sizes[:1]):
            raise ValueError("sizes must hold one int per sample (its length), not pairs")
        self.parts = num_replicas * accumulation  # micro-batches in a global batch
        longest = int(self.sizes.max())
        if max_batch_tokens < 2 * longest:
            raise ValueError(
                f"max_batch_tokens {max_batch_tokens} must hold two of the longest sample "
                f"({longest})"
            )
        if max_batch_size is not None and max_batch_size < 2:
            raise ValueError(f"max_batch_size must be at least 2, got {max_batch_size}")
        if len(self.sizes) < self.parts:
            raise ValueError(
                f"{len(self.sizes)} samples cannot fill the {self.parts} micro-batches of a step"
            )
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.shuffle, self.accumulation = shuffle, accumulation

    def rank_batches(self):
        """This rank's micro-batches of the current epoch: micro-step s of a global batch is its
        part s * num_replicas + rank."""
        mine = []
        for batch in self.global_batches():
            mine += split_evenly(batch, self.parts)[self.rank :: self.num_replicas]
        return mine

    def global_batches(self):
        """Every global batch of the current epoch, each a list of indices sorted by size."""
        rng = np.random.default_rng((self.seed, self.epoch))
        n, parts = len(self.sizes), self.parts
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        order = order[np.argsort(self.sizes[order], kind="stable")].tolist()  # ties stay shuffled
        sizes = self.sizes[order].tolist()
        cap = self.max_batch_size or n

        def fits(per_part, last):  # per_part samples in each micro-batch, the longest at `last`
            return per_part <= cap and per_part * sizes[last] <= self.max_batch_tokens

        batches, start = [], 0
        while start < n:
            if fits(-(-(n - start) // parts), n - 1):  # the rest fits one step
                batches.append(order[start:])
                break
            per_part = 1  # fits: twice the longest sample fits the budget
            while start + (per_part + 1) * parts <= n and fits(
                per_part + 1, start + (per_part + 1) * parts - 1
            ):
                per_part += 1
            batches.append(order[start : start + per_part * parts])
            start += per_part * parts
        if len(batches[-1]) < parts:  # fewer samples left than micro-batches: form the last two
            rest = batches.pop(-2) + batches.pop(-1)  # again, still sorted
            cut = len(rest) - parts if len(rest) >= 2 * parts else len(rest)
            batches += [rest[:cut], rest[cut:]] if cut < len(rest) else [rest]
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches


def split_evenly(items, parts):
    """`items` cut into `parts` runs in their order, of len // parts items or one more (the
    first ones)."""
    base, extra = divmod(len(items), parts)
    bounds = np.cumsum([0] + [base + (j < extra) for j in range(parts)]).tolist()
    return [items[bounds[j] : bounds[j + 1]] for j in range(parts)]


def rounded_lengths(lengths, per_octave=32, multiple=8):
    """Each length rounded up to one of `per_octave` steps per doubling (at least `multiple`), as
    an int64 array: 4000 becomes 4032, 100 becomes 104. Lengths within about 3% then tie, so
    that a sampler that sorts by size groups them differently every epoch, and a batch padded to
    its longest rounded length wastes at most about 3% on padding."""
    lengths = np.asarray(lengths, dtype=np.int64)
    octave = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)  # 2**octave <= length
    step = np.maximum(2 ** np.maximum(octave - int(np.log2(per_octave)), 0), multiple)
    return -(-lengths // step) * step


def sharded_loader(
    dataset, batch_sampler, accelerator, collate_fn=None, num_workers=0, seed=0, pin_memory=None
):
    """A DataLoader of a batch sampler that yields this rank's batches already (a
    GlobalBucketSampler, or bucket_loader's BucketBatchSampler), on the accelerator's device:
    prepared with num_processes=1, so that Accelerate does not deal the batches out again, and
    still gets set_epoch, skip_first_batches and the end-of-epoch signal for gradient
    accumulation. Pinned memory on a GPU (pin_memory None; False for batches already there). Its
    own generator (seeded by `seed`): starting an epoch draws nothing from the global RNG, so a
    resumed run draws the same dropout masks as an uninterrupted one (a DataLoader without one
    takes its workers' seed from the global RNG)."""
    loader = DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,  # not restarted every epoch
        worker_init_fn=ignore_stop_signals,  # Ctrl-C is the training process's to handle
        pin_memory=accelerator.device.type == "cuda" if pin_memory is None else pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )  # with non_blocking: the copy to the GPU does not wait for it
    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=1,
        process_index=0,
        put_on_device=accelerator.device_placement,
        non_blocking=accelerator.non_blocking,
    )
