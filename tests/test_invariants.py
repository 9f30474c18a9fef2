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
