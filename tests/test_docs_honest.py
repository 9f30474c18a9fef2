"""The README, the pages of docs/ and scripts/studies/README.md say only what a reader can use
and check. They name no issue numbers and no commit ids (a reader has neither: a page says what
to set and why, and dates its figures). And the commands they show run as written: every `make
TARGET` is a target of the Makefile, every file of the repository they name exists, and every
--flag is a setting of the recipe (its Config with RunConfig's fields, or its serving file's
ServingConfig), an option of the script, or one of the launcher's. The settings are read from
the recipes' source (ast): the test imports no torch, and takes well under a second."""

import ast
import functools
import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
PAGES += [p for p in [REPO / "scripts" / "studies" / "README.md"] if p.exists()]

# ---- No issue numbers, no commit ids ----

# `issue 46`, `issues 38 and 46`, `Issue #48`, `PR 12`; and outside code, `#46` (in code, `#000`
# is a colour). Another project's issue may be cited by its name, at most 6 words before:
# `Accelerate issues 207`, `milesial/Pytorch-UNet's users asked for in its issue 519`.
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+", re.IGNORECASE)
HASH_NUMBER = re.compile(r"(?<![\w&#/])#\d{1,5}\b")
OTHER_PROJECT = re.compile(r"\b(?:Accelerate|PyTorch|[\w.-]+/[\w.-]+)(?:'s)?(?:\s+[\w']+){0,6}\s+$")
# A commit id: 7 to 40 hex digits with at least one digit and one letter (not `decade`, not
# `1234567`), a word of its own: not part of a file name (`resnet34-b627a593.pth`, an email's
# MD5 `easy-ham-1.00007.37a8af84...txt`), a path or URL, or a colour (`#a0b1c2ff`). A SHA-256
# digest has 64 digits: no word of 7 to 40.
COMMIT = re.compile(
    r"(?<![\w.\-/#])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w\-/]|\.\w)"
)


def lines_of(text):
    """(line number, line, in a fenced code block) for each line of a Markdown page but fences."""
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        yield number, line, in_code


def inline_code(line):
    """The line with its `code spans` blanked, and the spans."""
    spans = re.findall(r"`[^`]*`", line)
    return re.sub(r"`[^`]*`", lambda m: " " * len(m[0]), line), spans


def references(line, in_code):
    """The issue numbers and commit ids a line names, each once."""
    issues = list(ISSUE.finditer(line))
    found = [m[0] for m in issues if not OTHER_PROJECT.search(line[: m.start()])]
    if not in_code:  # `#46` alone, in the prose but the issues found and the code spans
        prose = ISSUE.sub(lambda m: " " * len(m[0]), inline_code(line)[0])
        found += HASH_NUMBER.findall(prose)
    return found + COMMIT.findall(line)


def test_references_are_told_from_colours_digests_words_and_file_names():
    named = {
        "as issue 46 asks": ["issue 46"],
        "issues 38 and 46 ask": ["issues 38"],
        "fixed in #46, and Issue #48 too": ["Issue #48", "#46"],
        "measured at 7dfb538, and c1aedab.": ["7dfb538", "c1aedab"],
        "(commit 3dd30d7f4e)": ["3dd30d7f4e"],
        "Accelerate runs it, as issue 46 asks": ["issue 46"],  # not Accelerate's issue
    }
    for line, found in named.items():
        assert sorted(references(line, in_code=False)) == sorted(found), line
    for line in [
        "--mask_values `#000000,#408040` --fill `#555`, #a0b1c2ff",  # colours
        "a decade of deadbeef cafe facade; 1234567 samples",  # hex words, numbers
        "sha256 " + "3f" * 32,  # a digest
        "`resnet34-b627a593.pth`, ham/easy-ham-1.00007.37a8af848caae585af4fe35779656d55.txt",
        "https://github.com/owner/repo/commit/7dfb538",  # a path
        "as milesial/Pytorch-UNet's users asked for in its issue 519",  # another project's
        "Accelerate issues 207, 679 and 684 ask about the same",
    ]:
        assert references(line, in_code=False) == [], line
    assert references("--fill '#000' # 46 pixels", in_code=True) == []


def test_the_pages_name_no_issue_numbers_or_commit_ids():
    found = [
        f"{page.relative_to(REPO)}:{number}: {', '.join(refs)}: {line.strip()[:90]}"
        for page in PAGES
        for number, line, in_code in lines_of(page.read_text())
        if (refs := references(line, in_code))
    ]
    assert not found, "issue numbers or commit ids (say what to set and why, and dates):\n" + (
        "\n".join(found)
    )


# ---- The commands run as written ----


def make_targets(makefile):
    """The targets a Makefile defines by name (`demo`, `data/spam`), not its variables' ones."""
    targets = set()
    for line in makefile.read_text().splitlines():
        rule = re.match(r"([^\s:=#$][^:=#]*?)\s*::?(?!=)", line)
        if rule and not line.startswith("\t"):
            targets |= {t for t in rule[1].split() if not t.startswith(".")}
    return targets


@functools.cache
def classes_of(path):
    """{name: (ast.ClassDef, the file that defines it)} for the classes a module of the repository
    defines, or imports from another one (`from mnist import Config`, `from common.config import
    RunConfig`)."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            source = REPO.joinpath(*parts).with_suffix(".py")
            source = source if source.exists() else REPO / "recipes" / f"{parts[-1]}.py"
            names = {a.asname or a.name: a.name for a in node.names if a.name[:1].isupper()}
            if names and source.exists():
                imported = classes_of(source)
                found |= {n: imported[name] for n, name in names.items() if name in imported}
        elif isinstance(node, ast.ClassDef):
            found[node.name] = (node, path)
    return found


def fields(name, path):
    """The dataclass fields of the class `name` of the module at `path`: its annotated names but
    ClassVar ones, and those of its bases."""
    node, defined_in = classes_of(path)[name]
    own = {
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation)
    }
    known = classes_of(defined_in)
    bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in known]
    return own.union(*(fields(b, defined_in) for b in bases))


def settings(script):
    """recipes/X.py's settings: (its own, those it takes with --predict, --export or
    --check_data, which hand over to its serving file). A training file's own are its Config's
    fields, a serving file's (recipes/X_predict.py) its ServingConfig's."""
    if script.stem.endswith("_predict"):
        return fields("ServingConfig", script), set()
    serving = script.with_name(f"{script.stem}_predict.py")
    own = fields("Config", script)
    return own, (fields("ServingConfig", serving) - own if serving.exists() else set())


def script_options(script):
    """The options a script (scripts/X.py, argparse) names: its string constants `--name`."""
    return {
        n.value
        for n in ast.walk(ast.parse(script.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")
    }


# Accelerate's and torchrun's own options as the pages use them, before the script's path
# (`--max-restarts` is `--max_restarts`).
LAUNCHER_FLAGS = {
    "accelerate": {
        "--config_file",
        "--num_processes",
        "--num_machines",
        "--machine_rank",
        "--main_process_ip",
        "--main_process_port",
        "--multi_gpu",
        "--cpu",
        "--mixed_precision",
        "--num_cpu_threads_per_process",
        "--dynamo_backend",
        "--gpu_ids",
        "--rdzv_backend",
        "--max_restarts",
        "--monitor_interval",
        "-q",
        "--quiet",
    },
    "torchrun": {
        "--nproc_per_node",
        "--nnodes",
        "--node_rank",
        "--master_addr",
        "--master_port",
        "--rdzv_backend",
        "--rdzv_endpoint",
        "--rdzv_id",
        "--standalone",
        "--max_restarts",
        "--monitor_interval",
    },
}
# The folders of the repository whose files a command names: each must exist. data/ and runs/
# hold the reader's own folders, made ones, the shipped sample and the runs' outputs: not checked.
REPO_FOLDERS = ("recipes", "scripts", "accelerate_configs", "common", "tests", "docs")
# What a page writes for what the reader fills in: `python recipes/... --weights FILE`.
PLACEHOLDER = re.compile(r"\.\.\.|^FILE$")


def repo_path_problem(word, copies):
    """Why `word` (or the value of `NAME=word`), a path into one of REPO_FOLDERS, names nothing:
    neither a file of the repository (a glob: one at least) nor one of `copies`; None if it is no
    such path or names something."""
    path = word.split("=", 1)[-1]
    if path.split("/", 1)[0] not in REPO_FOLDERS or "/" not in path or path in copies:
        return None
    found = any(REPO.glob(path)) if any(c in path for c in "*?[") else (REPO / path).exists()
    return None if found else f"{path} does not exist"


def flag_names(words):
    """The --flags among a command's words, as the recipes and launchers read them
    (`--check-data=x`: `check_data`)."""
    return [
        w[2:].split("=", 1)[0].replace("-", "_") for w in words if w.startswith("--") and w != "--"
    ]


def recipe_problems(script, words, copies):
    """Why a recipe's command (recipes/X.py, or a copy of one, and its words) would stop on a
    setting it lacks."""
    own, serving = settings(REPO / copies.get(script, script))
    names = flag_names(words)
    handed_over = {"predict", "export", "check_data"} & set(names)
    problems = []
    for name in names:
        if name in own | {"config", "help"} or (handed_over and name in serving):
            continue
        why = (
            ": a serving setting: add --predict, --export or --check_data"
            if name in serving
            else ""
        )
        problems.append(f"--{name} is no setting of {script}{why}")
    return problems


def script_problems(script, words, copies):
    """Why `python SCRIPT WORDS` would not run as written: SCRIPT is missing, or a flag is none of
    its options (a recipe's: its settings); after `--`, a sweep's recipe command, alike."""
    if not (REPO / copies.get(script, script)).is_file():
        return [f"{script} does not exist"]
    if "--" in words:
        words, rest = words[: words.index("--")], words[words.index("--") + 1 :]
        if rest and rest[0].endswith(".py"):
            return script_problems(script, words, copies) + script_problems(
                rest[0], rest[1:], copies
            )
    if script.startswith("recipes/"):
        return recipe_problems(script, words, copies)
    options = script_options(REPO / script) | {"--help"}
    return [f"--{n} is no option of {script}" for n in flag_names(words) if f"--{n}" not in options]


def launch_problems(launcher, words, copies):
    """`accelerate launch` or `torchrun`: its own flags before the script, the script's after."""
    at = next((i for i, w in enumerate(words) if w.endswith(".py")), len(words))
    flags = [w for w in words[:at] if w.startswith("-")]
    problems = [
        f"{flag} is no {launcher} flag this test knows (LAUNCHER_FLAGS)"
        for flag in flags
        if ("--" + flag_names([flag])[0] if flag.startswith("--") else flag)
        not in LAUNCHER_FLAGS[launcher]
    ]
    return problems + (
        script_problems(words[at], words[at + 1 :], copies) if at < len(words) else []
    )


def command_problems(words, targets, copies=None):
    """Why one command (its words) would not run as written here, with `targets` as the
    Makefile's and `copies` ({path: the file it copies}) as the files its page made with `cp`."""
    copies = copies or {}
    while words and re.match(r"[A-Z_]+=", words[0]):  # OMP_NUM_THREADS=1 python ...
        words = words[1:]
    words = [w for w in words if not PLACEHOLDER.search(w)]
    if not words:
        return []
    program, args = Path(words[0]).name, words[1:]
    problems = [p for w in words if (p := repo_path_problem(w, copies))]
    if program == "make":
        problems += [
            f"make {t}: no such target"
            for t in args
            if not t.startswith("-") and "=" not in t and t not in targets
        ]
    elif program.startswith("python") and args and args[0].endswith(".py"):
        problems += script_problems(args[0], args[1:], copies)
    elif program == "accelerate" and args[:1] == ["launch"]:
        problems += launch_problems("accelerate", args[1:], copies)
    elif program == "torchrun":
        problems += launch_problems("torchrun", args, copies)
    return list(dict.fromkeys(problems))


def split_commands(line):
    """The commands of a shell line (`a && b; c | d`), each as its words, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands = [[]]
    for word in lexer:
        if word in (";", "&&", "||", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


COMMAND = re.compile(r"(?:make|python3?|accelerate launch|torchrun) ")


def commands_of(text):
    """(first line number, words) for each command a page shows: the lines of its bash blocks
    (joined where they end in a backslash or leave a quote open), and the code spans of its prose
    that start as one. In a block, a `cd` leaves the repository: the block's later commands run
    elsewhere, and are skipped, unless it enters the copy that a `make copy ... DEST=` of the block
    made (their words then start with "copy:"; its Makefile is scripts/take_away/Makefile)."""
    lang, pending, dests, inside, start = None, "", set(), "here", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            lang = (line[3:].strip() or "text") if lang is None else None
            pending, dests, inside = "", set(), "here"
            continue
        if lang is None:
            for span in inline_code(line)[1]:
                if COMMAND.match(span[1:-1]):
                    yield from ((number, c) for c in split_commands(span[1:-1]))
            continue
        if lang not in ("bash", "sh", "shell"):
            continue
        start = number if not pending else start
        pending += line
        if line.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            commands = split_commands(pending)
        except ValueError:  # a quote open: python -c "... over several lines
            pending += "\n"
            continue
        pending = ""
        for words in commands:
            if words[0] == "cd":
                inside = "copy" if words[1:] and words[1].rstrip("/") in dests else "elsewhere"
            elif words[0] == "make" and "copy" in words:
                dests |= {w.split("=", 1)[1].rstrip("/") for w in words if w.startswith("DEST=")}
            if words[0] != "cd" and inside != "elsewhere":
                yield start, (["copy:", *words] if inside == "copy" else words)


def copies_of(commands):
    """{path: the file it copies} for the files that `cp FILE PATH` commands write, in the
    repository (`cp recipes/unet.py recipes/my_seg.py`: a copy the page goes on to run)."""
    return {
        words[-1]: words[-2]
        for _, words in commands
        if words[0] == "cp" and len(words) >= 3 and not words[-2].startswith("-")
    }


def page_problems(page):
    """`file:line: why` for each command of a page that would not run as written. A file that a
    `cp` of the page writes exists for all its commands, with the settings of the file it copies."""
    targets = make_targets(REPO / "Makefile")
    copy_targets = make_targets(REPO / "scripts" / "take_away" / "Makefile")
    commands = list(commands_of(page.read_text()))
    copies = copies_of(commands)
    problems = []
    for number, words in commands:
        if words[0] == "copy:":  # in the copy: only its Makefile's targets are known here
            words = words[1:]
            found = command_problems(words, copy_targets) if words[0] == "make" else []
        else:
            found = command_problems(words, targets, copies)
        problems += [f"{page.relative_to(REPO)}:{number}: {p}" for p in found]
    return problems


def test_commands_are_read_as_a_shell_and_the_recipes_read_them():
    page = (
        "Run `make demo` and `make copy RECIPE=mnist DEST=../x`, then `python recipes/mnist.py "
        "--help`.\n```bash\nOMP_NUM_THREADS=1 python recipes/mnist.py --lr 0.5 --epochs=3 \\\n"
        "  --top_k 2  # a comment --nothing\nmake copy RECIPE=unet DEST=../my-seg\ncd ../my-seg\n"
        "make train\n```\n```bash\ncd /elsewhere && make anything\n```\n"
        "```bash\npython -c \"\nprint('#')\" && cp recipes/unet.py recipes/my.py\n```\n"
    )
    commands = list(commands_of(page))
    assert commands == [
        (1, ["make", "demo"]),
        (1, ["make", "copy", "RECIPE=mnist", "DEST=../x"]),
        (1, ["python", "recipes/mnist.py", "--help"]),
        (
            3,
            ["OMP_NUM_THREADS=1", "python", "recipes/mnist.py", *"--lr 0.5 --epochs=3".split()]
            + ["--top_k", "2"],
        ),
        (5, ["make", "copy", "RECIPE=unet", "DEST=../my-seg"]),
        (7, ["copy:", "make", "train"]),
        (13, ["python", "-c", "\nprint('#')"]),
        (13, ["cp", "recipes/unet.py", "recipes/my.py"]),
    ]
    assert copies_of(commands) == {"recipes/my.py": "recipes/unet.py"}
    targets = make_targets(REPO / "Makefile")
    assert {"demo", "copy", "venv", "data/spam", "test-full"} <= targets
    assert command_problems(["make", "copy", "RECIPE=mnist", "-j2"], targets) == []
    assert command_problems(["make", "nosuchtarget"], targets) == [
        "make nosuchtarget: no such target"
    ]
    mnist = ["python", "recipes/mnist.py", "--dataset", "data/mnist_sample"]
    assert command_problems([*mnist, "--check_data", "--lr=1", "--max-steps", "3"], targets) == []
    assert command_problems([*mnist, "--export", "onnx", "--top_k", "3"], targets) == []
    predict = ["python", "recipes/mnist_predict.py", "--weights", "FILE", "--top_k", "3", "x/*.png"]
    assert command_problems(predict, targets) == []
    assert command_problems([*mnist, "--top_k", "3", "--nosuch", "1"], targets) == [
        "--top_k is no setting of recipes/mnist.py: a serving setting: add --predict, --export or"
        " --check_data",
        "--nosuch is no setting of recipes/mnist.py",
    ]
    copied = ["python", "recipes/my.py", "--base_channels", "8", "--top_k", "3"]
    assert command_problems(copied, targets, {"recipes/my.py": "recipes/unet.py"}) == [
        "--top_k is no setting of recipes/my.py"
    ]
    assert command_problems(copied, targets) == ["recipes/my.py does not exist"]
    launch = ["accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml", "-q"]
    assert command_problems([*launch, "--num-processes", "2", *mnist[1:]], targets) == []
    assert command_problems(["accelerate", "launch", "--nosuch", *mnist[1:]], targets) == [
        "--nosuch is no accelerate flag this test knows (LAUNCHER_FLAGS)"
    ]
    assert command_problems(["torchrun", "--nproc_per_node", "2", "recipes/no.py"], targets) == [
        "recipes/no.py does not exist"
    ]
    sweep = ["python", "scripts/sweep.py", "--study", "s", "--", "recipes/unet.py", "--lr", "1"]
    assert command_problems(sweep, targets) == []
    assert command_problems([*sweep, "--bogus", "1"], targets) == [
        "--bogus is no setting of recipes/unet.py"
    ]
    assert command_problems(["python", "scripts/sweep.py", "--bogus"], targets) == [
        "--bogus is no option of scripts/sweep.py"
    ]
    assert command_problems(["cat", "accelerate_configs/nosuch.yaml"], targets) == [
        "accelerate_configs/nosuch.yaml does not exist"
    ]


@pytest.mark.slow
def test_the_settings_read_from_source_are_the_dataclass_fields():
    """The recipes' settings as settings() reads them are those the recipes parse: the fields of
    their Config and ServingConfig, imported (torch: seconds, hence the full tier only)."""
    import dataclasses

    from recipe_module import load_recipe

    for name in ("mnist", "unet", "text"):
        config = load_recipe(name).Config
        serving = load_recipe(f"{name}_predict").ServingConfig
        own, handed = settings(REPO / "recipes" / f"{name}.py")
        assert own == {f.name for f in dataclasses.fields(config)}, name
        assert own | handed == {f.name for f in dataclasses.fields(serving)}, name
        assert settings(REPO / "recipes" / f"{name}_predict.py")[0] == own | handed, name


def test_the_readme_commands_run_as_written():
    problems = page_problems(README)
    assert not problems, "README commands that would not run as written:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(REPO)))
def test_the_commands_of_the_docs_run_as_written(page):
    problems = page_problems(page)
    assert not problems, "commands that would not run as written:\n" + "\n".join(problems)
