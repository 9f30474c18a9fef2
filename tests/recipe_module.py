"""Import a recipe file as a module, for the tests and the probes they launch.

    from recipe_module import load_recipe
    unet = load_recipe("unet")      # recipes/unet.py: its Config, loaders, model, evaluate ...

It also puts the repository root and recipes/ on sys.path, so a probe launched as
`python tests/x.py` can import `common` and a recipe's helpers (unet_data).
"""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO / "recipes", REPO):  # a recipe's own helpers (unet_data.py), and common/
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def load_recipe(name):
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that inspect finds its source (--help reads the comments)
    spec.loader.exec_module(module)
    return module
