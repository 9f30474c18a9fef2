"""scripts/make_manpages.py: a manual's pages as one folder per section, each page once, without
the pages that only point at another or are links."""

import gzip
import hashlib
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_each_sections_real_pages_once_and_at_most_per_class(tmp_path):
    man = tmp_path / "man"
    for section, name, text in [
        ("1", "ls.1.gz", b".TH LS 1\nlist directory contents"),
        ("1", "dir.1.gz", b".so man1/ls.1"),  # points at another page
        ("1", "vdir.1.gz", b".TH LS 1\nlist directory contents"),  # the text of ls.1 again
        ("2", "open.2.gz", b".TH OPEN 2\nopen a file"),
        ("2", "read.2", b".TH READ 2\nread from a file descriptor"),  # not compressed
        ("8", "mount.8.gz", b".TH MOUNT 8\nmount a filesystem"),
        ("8", "umount.8.gz", b".TH UMOUNT 8\nunmount a filesystem"),
    ]:
        (man / f"man{section}").mkdir(parents=True, exist_ok=True)
        data = gzip.compress(text) if name.endswith(".gz") else text
        (man / f"man{section}" / name).write_bytes(data)
    (man / "man2" / "creat.2.gz").symlink_to(man / "man2" / "open.2.gz")

    def pages(per_class):
        out = tmp_path / f"pages-{per_class}"
        args = [sys.executable, REPO / "scripts" / "make_manpages.py", "--man", man, "--out", out]
        subprocess.run([*map(str, args), "--per_class", str(per_class)], check=True)
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.txt"))}

    def first(*names):  # of pages in one section, the first by the hash of its name
        return min(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())

    found = pages(per_class=5)
    kept = {f"1/{first('ls.1', 'vdir.1')}.txt", "2/open.2.txt", "2/read.2.txt", "8/mount.8.txt"}
    assert set(found) == kept | {"8/umount.8.txt"}  # no pointer, link or second copy of a text
    assert found["2/open.2.txt"] == b".TH OPEN 2\nopen a file"  # decompressed, as it is
    assert set(pages(per_class=1)) == {  # at most per_class pages a section
        f"1/{first('ls.1', 'vdir.1')}.txt",
        f"2/{first('open.2', 'read.2')}.txt",
        f"8/{first('mount.8', 'umount.8')}.txt",
    }
