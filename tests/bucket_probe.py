"""Launched by test_sampler.py on 1 or 2 processes: bucket_loader on mixed-size data, for real.

    python tests/bucket_probe.py SIZES.json  # {"train": [[h, w], ...], "test": [...], "budget": N}

It trains two epochs with a DDP model and one more all_reduce per batch (a rank with fewer
batches than the other would hang there), replays epoch 1, skips into epoch 2 as a mid-epoch
resume does, and evaluates with one reduce after the loop. Each rank writes what it saw to
$PROBE_OUT/rank{N}.json. Sample i is an image of its size whose pixels all equal i.
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from common.accelerator import build_accelerator, close  # noqa: E402
from common.sampler import bucket_loader  # noqa: E402

SEED, RESUME_AT = 3, 2


class MixedSizes(Dataset):
    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        h, w = self.sizes[i]
        return torch.full((1, h, w), float(i)), i


def pad_collate(samples):
    """Pad every image to the batch's largest height and width."""
    h = max(x.shape[1] for x, _ in samples)
    w = max(x.shape[2] for x, _ in samples)
    images = torch.zeros(len(samples), 1, h, w)
    for k, (x, _) in enumerate(samples):
        images[k, :, : x.shape[1], : x.shape[2]] = x
    return images, torch.tensor([i for _, i in samples])


def ids_of(loader):
    return [ids.tolist() for _, ids in loader]


spec = json.loads(Path(sys.argv[1]).read_text())
budget = spec["budget"]
accelerator = build_accelerator(seed=SEED, timeout_s=60)  # a hang fails in a minute, not ten
train_loader = bucket_loader(
    MixedSizes(spec["train"]),
    spec["train"],
    budget,
    accelerator,
    train=True,
    seed=SEED,
    collate_fn=pad_collate,
)
test_loader = bucket_loader(
    MixedSizes(spec["test"]), spec["test"], budget, accelerator, train=False, collate_fn=pad_collate
)
model = nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1),
    nn.BatchNorm2d(4),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(4, 1),
)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
model, optimizer = accelerator.prepare(model, optimizer)

report = {"len": len(train_loader), "train": {}, "shapes": [], "global_samples": {}}
for epoch in (1, 2):
    train_loader.set_epoch(epoch)
    batches, total = [], 0
    for images, ids in train_loader:
        loss = model(images / len(spec["train"])).square().mean()
        accelerator.backward(loss)  # DDP: an all_reduce of the gradients
        optimizer.step()
        optimizer.zero_grad()
        total += accelerator.reduce(torch.tensor(len(ids), device=accelerator.device), "sum").item()
        batches.append(ids.tolist())
        report["shapes"].append(list(images.shape))
    report["train"][epoch] = batches
    report["global_samples"][epoch] = total

train_loader.set_epoch(1)
report["replay_epoch1"] = ids_of(train_loader)
train_loader.set_epoch(2)
report["resumed_epoch2"] = ids_of(accelerator.skip_first_batches(train_loader, RESUME_AT))

# Exact evaluation: ranks may hold different numbers of batches, so no collective inside the
# loop (the unwrapped model), one reduce after it.
net = accelerator.unwrap_model(model, keep_torch_compile=False).eval()
totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
eval_batches = []
with torch.inference_mode():
    for images, ids in test_loader:
        net(images)
        totals[0] += len(ids)
        totals[1] += ids.sum()
        eval_batches.append(ids.tolist())
samples, id_sum = accelerator.reduce(totals, "sum").tolist()
report.update(
    eval=eval_batches,
    eval_len=len(test_loader),
    eval_samples=samples,
    eval_id_sum=id_sum,
    device=str(images.device),
    world_size=accelerator.num_processes,
)

out = Path(os.environ["PROBE_OUT"])
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
del model, optimizer, train_loader, test_loader, net
close(accelerator)
