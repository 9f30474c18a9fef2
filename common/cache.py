"""Tensors made once and read from a file by later runs: the decoded-data cache.

    key = [split._fingerprint, "image", "label"]  # the data and the settings the tensors come from
    x, y = cached_tensors(key, decode)  # decode() in the first run; later runs read the file
    images, masks = cached_tensors(key, make, code=[read_pair])  # functions make() gets as values

The file lies under the datasets cache (HF_DATASETS_CACHE/decoded/). It is named by `key` and by
the code that makes the tensors: `make`, the functions in `code`, and every function and class
of the project they use by global name, followed through the ones those use (the standard
library and installed packages are not followed). A nested function counts with the function
that defines it, where its closure's values come from. Edit the decoding, or a helper it calls in
the recipe or in common/, and the next run decodes again; edit anything else and it reads the
file. A datasets split's `_fingerprint` names its data files (their paths and modification
times, or the hub revision).

A JSON value is kept the same way, for what is not tensors (the U-Net's mask scan):

    found = read_json(key, code=[scan])   # None the first time, or after an edit of scan
    write_json(key, found, code=[scan])
"""

import functools
import hashlib
import inspect
import json
import os
import sys
import sysconfig
import uuid
from pathlib import Path
from types import CodeType, FunctionType, MethodType

CACHE_FORMAT = 1  # part of every cache key: raise it when what cached_tensors stores changes
# Code in these folders, or in a site-packages folder anywhere, is not the project's: the standard
# library and installed packages.
INSTALLED = tuple(
    os.path.join(sysconfig.get_path(name), "")
    for name in ("stdlib", "platstdlib", "purelib", "platlib")
)


def cached_tensors(key, make, *, code=(), enabled=True):
    """The tuple of tensors that make() computes, made once: later runs read them from a file
    keyed by `key` (a JSON-able value: what data and settings the tensors come from) and by the
    code (code_fingerprint of make and `code`: the functions whose code shapes the tensors but
    that make() receives as values, not by global name). The file is written atomically, a
    temporary file then os.replace, so no process ever reads half a file; one that does not read
    is made again and replaced, with a warning. enabled=False: make() every time, no file."""
    if not enabled:
        return make()
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    path, name = _cache_file(key, [make, *code], ".safetensors")
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
    _write_atomically(
        path,
        lambda tmp: save_file(
            {str(i): t.contiguous() for i, t in enumerate(tensors)}, tmp, {"key": name}
        ),
        errors=(OSError, SafetensorError),
        again="decoding again next run",
    )
    return tensors


def read_json(key, *, code):
    """The value that write_json() stored under `key` and `code` (as cached_tensors keys its
    files), or None if there is none; a file that does not read warns and counts as none."""
    path, name = _cache_file(key, code, ".json")
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == name:
            return stored["value"]
        problem = "made for other data"
    except (OSError, ValueError, AttributeError, KeyError) as e:  # truncated or damaged
        problem = _first_line(e) if str(e) else type(e).__name__
    print(f"warning: cannot read cache file {path} ({problem}): writing it again", file=sys.stderr)
    return None


def write_json(key, value, *, code):
    """Keep a JSON-able `value` for read_json(), written atomically; a failure warns."""
    path, name = _cache_file(key, code, ".json")
    text = json.dumps({"key": name, "value": value})
    _write_atomically(
        path, lambda tmp: Path(tmp).write_text(text), errors=(OSError,), again="making it again"
    )


def _cache_file(key, code, suffix):
    """(path, name): the file under HF_DATASETS_CACHE/decoded/ for `key` and `code`, and the full
    name it stores inside, which tells two keys whose hashes meet apart."""
    import datasets

    name = json.dumps([CACHE_FORMAT, key, code_fingerprint(code)], sort_keys=True)
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    return Path(datasets.config.HF_DATASETS_CACHE, "decoded", digest + suffix), name


def _write_atomically(path, write, *, errors, again):
    """write(tmp) to a temporary file, then os.replace it onto `path`, so no process ever reads
    half a file. A full disk or a read-only cache warns and the run goes on without the file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # unique: ranks write at once
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except errors as e:
        if tmp.exists():  # written in part (exists() is False where `decoded` is no folder)
            tmp.unlink()
        print(
            f"warning: cannot write cache file {path} ({_first_line(e)}): {again}",
            file=sys.stderr,
        )


def code_fingerprint(functions):
    """A hex digest of the code of `functions` and of the project code they reach (code_reached):
    the same in every process and run for the same code, another for edited code."""
    own = sorted(_own_code(obj)[0] for obj in code_reached(functions))
    return hashlib.sha256("\n".join(own).encode()).hexdigest()


def code_reached(functions):
    """`functions` (of a method its function, of another callable its class), then, followed
    recursively, the functions and classes of the project that they name as globals, and the
    function that defines a nested one: a list, each once."""
    reached = {}
    todo = [f.__func__ if isinstance(f, MethodType) else f for f in functions]
    todo = [f if isinstance(f, (FunctionType, type)) else type(f) for f in todo]
    while todo:
        obj = todo.pop(0)
        if obj not in reached:
            reached[obj] = None
            todo.extend(_own_code(obj)[1])
    return list(reached)


@functools.cache  # once per function or class in a process
def _own_code(obj):
    """(a digest of the code of a function or class, the project's functions and classes that it
    uses). The code is the source text where inspect finds it, else the bytecode (a function
    made by exec or typed at the prompt)."""
    functions = list(_functions_of_class(obj)) if isinstance(obj, type) else [obj]
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):  # no source file
        text = "\n".join(_code_text(f.__code__) for f in functions)
    uses = [base for base in obj.__mro__[1:] if _in_project(base)] if isinstance(obj, type) else []
    for f in functions:
        names = list(_names(f.__code__))
        if "<locals>" in f.__qualname__:  # nested: the function that defines it (its closure)
            names.append(f.__qualname__.split(".")[0])
        for name in names:
            value = f.__globals__.get(name)
            if isinstance(value, (FunctionType, type)) and _in_project(value):
                uses.append(value)
    return hashlib.sha256(text.encode()).hexdigest(), tuple(dict.fromkeys(uses))


def _functions_of_class(cls):
    """The functions of a class body: its methods, static and class methods, and properties."""
    for value in vars(cls).values():
        for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
            if isinstance(f, FunctionType):
                yield f


def _names(code):
    """The global (and attribute) names that a code object and the code nested in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):  # a nested function, lambda or comprehension
            yield from _names(const)


def _in_project(obj):
    """True for a function or class of the project (a recipe, a copy, common/), False for one of
    the standard library (frozen modules too), of an installed package, or built in."""
    try:
        path = obj.__code__.co_filename if isinstance(obj, FunctionType) else inspect.getfile(obj)
    except TypeError:  # a built-in class, or one of a module without a file
        return False
    parts = Path(path).parts
    installed = "site-packages" in parts or "dist-packages" in parts
    return not (installed or path.startswith(("<frozen ", *INSTALLED)))


def _code_text(code):
    """A code object as text that is the same in every process: bytecode, names, constants."""
    names = (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
    return f"{code.co_code.hex()} {names} {_const_text(code.co_consts)}"


def _const_text(value):
    if isinstance(value, CodeType):  # a nested function: its text, not its address
        return _code_text(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_const_text(v) for v in value) + ")"
    if isinstance(value, frozenset):  # `x in {"a", "b"}`: the order depends on the hash seed
        return "frozenset(" + ", ".join(sorted(_const_text(v) for v in value)) + ")"
    return repr(value)


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
