"""Launched by test_errors.py with 2 processes: one rank fails mid-epoch, the other keeps
calling collectives. The job must end, quickly, with the failing rank's error shown.

    rank_failure_probe.py raise   # rank 1 raises at step 3
    rank_failure_probe.py hang    # rank 1 stops answering at step 3 (stuck, not dead)
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.accelerator import build_accelerator  # noqa: E402

mode, timeout_s = sys.argv[1], int(sys.argv[2])
accelerator = build_accelerator(timeout_s=timeout_s)
model = accelerator.prepare(torch.nn.Linear(4, 1))
for step in range(1, 10_000):
    if accelerator.process_index == 1 and step == 3:
        if mode == "raise":
            raise RuntimeError("rank 1 failed at step 3 (planted by the test)")
        time.sleep(3600)
    model(torch.randn(8, 4)).sum().backward()  # DDP all-reduces the gradients
    time.sleep(0.01)
