"""The start-up's note when torch runs more threads than the CPU cores that other work leaves free
(common.accelerator.busy_cores_note): in-process, with the load average set, and in the start-up
of both recipes, launched."""

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, assert_ok, launch

FIX = "OMP_NUM_THREADS=1 python ..., or accelerate launch --num_cpu_threads_per_process 1 ..."


def test_the_note_names_the_threads_the_load_and_the_fix_on_busy_cores_only(monkeypatch):
    from common.accelerator import busy_cores_note

    cpu = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    notes = {}
    for load in (0.3, 0.9, 1.0, 3.4):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        notes[load] = busy_cores_note(cpu)
    # Another job holding a whole core: 2 threads on the 1 core left. Below that, no note.
    assert notes[0.3] is None and notes[0.9] is None
    assert notes[3.4] == (
        "note: torch runs 2 threads on 2 CPU cores with a load average of 3.4: on busy cores the "
        "threads wait for each other, and one thread per process can be several times faster: "
        f"{FIX} (docs/performance.md)"
    )
    assert notes[1.0].startswith("note: torch runs 2 threads on 2 CPU cores with a load average")
    # 2 processes of 1 thread each on 2 cores with one of them busy: 2 threads on 1 free core,
    # but a single thread each has nothing to give up.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "2 threads in each of 2 processes" in busy_cores_note(cpu)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert busy_cores_note(cpu) is None
    # On a GPU the CPU threads do not run the model.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert busy_cores_note(SimpleNamespace(device=torch.device("cuda"))) is None


@pytest.mark.slow
def test_both_recipes_say_it_at_start_up(tiny_mnist, shapes, tmp_path):
    # A machine whose cores are all busy, as the load average tells Python (sitecustomize runs
    # before the recipe); 2 torch threads.
    (tmp_path / "sitecustomize.py").write_text("import os\nos.getloadavg = lambda: (99.0,) * 3\n")
    busy = {"OMP_NUM_THREADS": "2", "PYTHONPATH": str(tmp_path)}
    for args in (
        ["recipes/mnist.py", "--dataset", tiny_mnist, "--batch_size", 32],
        ["recipes/unet.py", "--dataset", shapes, *FAST],
    ):
        res = launch(
            [*args, "--smoke", "--output_dir", tmp_path / args[0][8:12]],
            launcher="python",
            env=busy,
        )
        assert_ok(res)
        assert "note: torch runs 2 threads on " in res.output, res
        assert "load average of 99.0: on busy cores the threads wait for each other" in res.output
