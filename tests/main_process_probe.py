"""Launched by test_pairing_scales.py on 2 processes: from_main_process (common/accelerator.py).

    accelerate launch --multi_gpu --num_processes 2 tests/main_process_probe.py

Each rank calls from_main_process twice: with a computation that notes which rank ran it, and
with one that raises a DataError. It writes what it got to $PROBE_OUT/rank{N}.json; the ranks
that ran the computation add themselves to $PROBE_OUT/ran.txt.
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.accelerator import build_accelerator, close, from_main_process  # noqa: E402
from common.data import DataError  # noqa: E402

out = Path(os.environ["PROBE_OUT"])
accelerator = build_accelerator(seed=0, timeout_s=60)  # a hang fails in a minute, not ten
rank = accelerator.process_index


def compute():
    with open(out / "ran.txt", "a") as f:
        f.write(f"{rank}\n")
    return {"pairs": [["a.png", "a_mask.png"]], "by": rank}


def fail():
    raise DataError(f"a.png has no mask (seen on rank {rank})")


result = from_main_process(accelerator, compute)
try:
    from_main_process(accelerator, fail)
    error = None
except DataError as e:
    error = str(e)
(out / f"rank{rank}.json").write_text(json.dumps({"result": result, "error": error}))
close(accelerator)
