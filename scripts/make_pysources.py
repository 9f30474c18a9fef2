"""Python source files as the text recipe's folders, one per library: OUT/<library>/<file>.py.

    python scripts/make_pysources.py --out data/pysources          # `make data/pysources`

Seven classes of real source code of very uneven length, from the libraries that
requirements.txt and requirements-extras.txt install (numpy, scipy, pandas, scikit-learn, sympy,
networkx, torch): which library does a file belong to? Each file as bytes, named by its path in
the library. Left out: files under 200 bytes (empty __init__.py and the like) and a file whose
bytes another file already has. Of a library with more than --per_class files, the first by a
hash of the file's path are kept, so that the same installation gives the same folders. The
recipe splits them itself (val_fraction, by a hash of each document's bytes).
"""

import argparse
import hashlib
import importlib.util
import shutil
from pathlib import Path

LIBRARIES = ("numpy", "scipy", "pandas", "sklearn", "sympy", "networkx", "torch")


def sources(library):
    """(path in the library, bytes) of its .py files of 200 bytes or more, in a fixed order; a
    library that is not installed has none."""
    spec = importlib.util.find_spec(library)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(spec.submodule_search_locations[0])
    found = []
    for path in root.rglob("*.py"):
        text = path.read_bytes()
        if len(text) >= 200:
            name = path.relative_to(root).as_posix()
            found.append((hashlib.sha256(name.encode()).hexdigest(), name, text))
    return [(name, text) for _, name, text in sorted(found)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--per_class", type=int, default=300, help="files of a library at most")
    p.add_argument("--libraries", nargs="+", default=LIBRARIES, help="importable packages")
    args = p.parse_args()
    out, seen = Path(args.out), set()
    shutil.rmtree(out, ignore_errors=True)
    for library in args.libraries:
        kept = 0
        for name, text in sources(library):
            digest = hashlib.sha256(text).digest()
            if digest in seen or kept == args.per_class:
                continue
            seen.add(digest)
            (out / library).mkdir(parents=True, exist_ok=True)
            (out / library / name.replace("/", "__")).write_bytes(text)
            kept += 1
        print(f"{out}/{library}: {kept} files")


if __name__ == "__main__":
    main()
