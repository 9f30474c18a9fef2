"""Tensors made once and read from a file by later runs: the decoded-data cache.

    key = [split._fingerprint, "image", "label"]  # the data and the settings the tensors come from
    x, y = cached_tensors(key, decode)  # decode() in the first run; later runs read the file

The file lies under the datasets cache (HF_DATASETS_CACHE/decoded/), named by `key`. A datasets
split's `_fingerprint` names its data files (their paths and modification times, or the hub
revision).
"""

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

CACHE_FORMAT = 1  # part of every cache key: raise it when what cached_tensors stores changes


def cached_tensors(key, make, *, enabled=True):
    """The tuple of tensors that make() computes, made once: later runs read them from a file
    keyed by `key` (a JSON-able value: what data and settings the tensors come from). The file
    is written atomically, a temporary file then os.replace, so no process ever reads half a
    file; one that does not read is made again and replaced, with a warning. enabled=False:
    make() every time, no file."""
    if not enabled:
        return make()
    import datasets
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    name = json.dumps([CACHE_FORMAT, key], sort_keys=True)
    path = Path(
        datasets.config.HF_DATASETS_CACHE,
        "decoded",
        hashlib.sha256(name.encode()).hexdigest()[:32] + ".safetensors",
    )
    if path.exists():
        try:
            with safe_open(path, "pt") as file:
                if file.metadata() == {"key": name}:  # else another key of that name: as if none
                    return tuple(file.get_tensor(str(i)) for i in range(len(file.keys())))
            problem = "made for other data"
        except (OSError, SafetensorError) as e:  # truncated or damaged
            problem = _first_line(e)
        print(
            f"warning: cannot read cache file {path} ({problem}): writing it again", file=sys.stderr
        )
    tensors = make()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # unique: ranks write at once
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({str(i): t.contiguous() for i, t in enumerate(tensors)}, tmp, {"key": name})
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a full disk or a read-only cache: run on without
        tmp.unlink(missing_ok=True)
        print(
            f"warning: cannot write cache file {path} ({_first_line(e)}): decoding again next run",
            file=sys.stderr,
        )
    return tensors


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
