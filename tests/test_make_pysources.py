"""scripts/make_pysources.py: the Python files of installed libraries as one folder per library,
each file once, without the small ones."""

import hashlib
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_each_librarys_files_once_and_at_most_per_class(tmp_path):
    site = tmp_path / "site"
    code = b"def f(x):\n    return x\n" * 10  # 250 bytes
    for path, text in [
        ("alpha/__init__.py", b""),  # under 200 bytes: left out
        ("alpha/core.py", code + b"# core\n"),
        ("alpha/sub/io.py", code + b"# io\n"),
        ("alpha/copy.py", code + b"# core\n"),  # the bytes of core.py again
        ("beta/__init__.py", code + b"# beta\n"),
    ]:
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_bytes(text)

    def files(per_class):
        out = tmp_path / f"files-{per_class}"
        args = [sys.executable, REPO / "scripts" / "make_pysources.py", "--out", out]
        args += ["--per_class", per_class, "--libraries", "alpha", "beta", "gamma"]
        env = {**os.environ, "PYTHONPATH": str(site)}
        subprocess.run([str(a) for a in args], check=True, env=env)  # gamma: not installed
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.py"))}

    def first(*names):  # of a library's files, the first by the hash of its path
        return min(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())

    twin = first("copy.py", "core.py")
    found = files(per_class=5)
    assert set(found) == {f"alpha/{twin}", "alpha/sub__io.py", "beta/__init__.py"}
    assert found["alpha/sub__io.py"] == code + b"# io\n"  # as it is, named by its path
    assert set(files(per_class=1)) == {
        f"alpha/{first(twin, 'sub/io.py').replace('/', '__')}",
        "beta/__init__.py",
    }
