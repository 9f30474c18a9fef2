"""Manual pages as the text recipe's folders, one per section: OUT/<section>/<page>.txt.

    python scripts/make_manpages.py --out data/manpages          # `make data/manpages`

Six classes of real technical documents of very uneven length, from the Debian packages installed
on this machine (/usr/share/man, English): 1 user commands, 2 system calls, 3 library functions,
5 file formats, 7 overviews and conventions, 8 administration commands. Each page is its roff
source, decompressed, as bytes. Left out: pages that only point at another (`.so`), links, and
a page whose text another page already has. Of a section with more than --per_class pages, the
first by a hash of the page's name are kept, so that the same machine gives the same folders.
The recipe splits them itself (val_fraction, by a hash of each document's bytes).
"""

import argparse
import gzip
import hashlib
import shutil
from pathlib import Path

SECTIONS = ("1", "2", "3", "5", "7", "8")


def pages(folder):
    """(name, roff bytes) of the section folder's real pages, in a fixed order."""
    found = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.is_symlink() or not path.is_file():
            continue
        text = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        if text.lstrip().startswith(b".so "):  # points at another page
            continue
        name = path.name.removesuffix(".gz")
        found.append((hashlib.sha256(name.encode()).hexdigest(), name, text))
    return [(name, text) for _, name, text in sorted(found)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--man", default="/usr/share/man", help="the manual's root, with man1/ ...")
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--per_class", type=int, default=400, help="pages of a section at most")
    args = p.parse_args()
    out, seen = Path(args.out), set()
    shutil.rmtree(out, ignore_errors=True)
    for section in SECTIONS:
        kept = 0
        for name, text in pages(Path(args.man) / f"man{section}"):
            digest = hashlib.sha256(text).digest()
            if digest in seen or kept == args.per_class:
                continue
            seen.add(digest)
            (out / section).mkdir(parents=True, exist_ok=True)
            (out / section / f"{name}.txt").write_bytes(text)
            kept += 1
        print(f"{out}/{section}: {kept} pages")


if __name__ == "__main__":
    main()
