"""One owner for each invariant (issue 24): small in-process checks of common/ and the recipes'
shape. The behaviours themselves are tested by launching the recipes, in the other files."""

import accelerate
import accelerate.optimizer

from common import runtime

def test_the_accelerate_patch_applies_only_on_the_release_it_was_measured_on(monkeypatch):
    def is_lomo_available():
        return False

    for version, patched in (("1.15.0", True), ("1.16.0", False), ("1.1.5", False)):
        monkeypatch.setattr(accelerate, "__version__", version)
        monkeypatch.setattr(accelerate.optimizer, "is_lomo_available", is_lomo_available)
        runtime._ask_for_lomo_once()
        assert hasattr(accelerate.optimizer.is_lomo_available, "cache_info") == patched, version
    assert accelerate.optimizer.is_lomo_available is is_lomo_available  # 1.1.5 left it alone


def test_stop_signals_are_caught_only_once_the_recipe_says_so(tmp_path, monkeypatch):
    import os
    import signal
    from types import SimpleNamespace

    import torch

    from common import signals
    from common.progress import Progress
    from recipe_module import load_recipe

    monkeypatch.setattr(signals, "_stop", signals._StopRequest())
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Starting an epoch is bookkeeping only: Ctrl-C still acts as usual.
        cfg = load_recipe("mnist").Config(output_dir=str(tmp_path))
        accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
        Progress(accelerator, cfg, metric="accuracy").start_epoch(8)
        assert {sig: signal.getsignal(sig) for sig in before} == before
        assert not signals.stop_was_requested()
        signals.catch_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once: a flag, not an exit
        assert signals.stop_was_requested()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
