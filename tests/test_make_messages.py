"""scripts/make_messages.py: the translated messages of a locale tree as one folder per language,
each message once, without the short ones, those of more than one language, and catalogs that
cannot be read."""

import gettext
import hashlib
import struct
import subprocess
import sys

import pytest
from conftest import REPO

HEADER = b"Content-Type: text/plain; charset=UTF-8\n"  # the catalog's entry for ""


def catalog(path, messages):
    """A GNU .mo file of {source: translation}, written as UTF-8, as msgfmt writes it."""
    pairs = sorted([(b"", HEADER)] + [(k.encode(), v.encode()) for k, v in messages.items()])
    start = 7 * 4 + 16 * len(pairs)  # the header, then the two tables of (length, offset)
    keys = b"".join(k + b"\0" for k, _ in pairs)
    values = b"".join(v + b"\0" for _, v in pairs)
    table, offset = [], start
    for k, _ in pairs:
        table += [len(k), offset]
        offset += len(k) + 1
    for _, v in pairs:
        table += [len(v), offset]
        offset += len(v) + 1
    n = len(pairs)
    head = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + struct.pack(f"<{4 * n}I", *table) + keys + values)


@pytest.mark.slow
def test_each_languages_long_messages_once_and_at_most_per_class(tmp_path):
    locale = tmp_path / "locale"
    shared = "GNU General Public License version 3"  # left untranslated in both: left out
    catalog(
        locale / "de" / "LC_MESSAGES" / "tar.mo",
        {
            "file not found: %s": "Datei nicht gefunden: %s",
            "yes": "ja",  # under 4 words
            "the file is empty now": "die Datei ist jetzt leer",
            "same in English too": "same in English too",  # not translated
            "GPL": shared,
        },
    )
    catalog(locale / "de" / "LC_MESSAGES" / "sed.mo", {"no input file": "Datei nicht gefunden: %s"})
    catalog(
        locale / "nl" / "LC_MESSAGES" / "tar.mo", {"a b c d": "een twee drie vier", "G": shared}
    )
    # A catalog that names UTF-8 but holds a Latin-1 byte cannot be read: all of it is left out.
    catalog(locale / "sv" / "LC_MESSAGES" / "tar.mo", {"x y z w": "ej \xe9n fil finns"})
    path = locale / "sv" / "LC_MESSAGES" / "tar.mo"
    path.write_bytes(path.read_bytes().replace("\xe9".encode(), b"\xe9 "))  # the same length
    with open(path, "rb") as f, pytest.raises(UnicodeDecodeError):
        gettext.GNUTranslations(f)

    def folders(per_class):
        out = tmp_path / f"messages-{per_class}"
        args = [sys.executable, REPO / "scripts" / "make_messages.py", "--locale", locale]
        args += ["--out", out, "--per_class", per_class, "--languages", "de", "nl", "sv", "fi"]
        subprocess.run(list(map(str, args)), check=True)
        found = {}
        for path in out.rglob("*.txt"):
            found.setdefault(path.parent.name, set()).add(path.read_text())
        return found

    def name(lang, text):  # each file is named by the hash that orders the language's messages
        return hashlib.sha256(f"{lang}\n{text}".encode()).hexdigest()

    de = {"Datei nicht gefunden: %s", "die Datei ist jetzt leer"}
    assert folders(per_class=5) == {"de": de, "nl": {"een twee drie vier"}}
    assert folders(per_class=1) == {
        "de": {min(de, key=lambda t: name("de", t))},
        "nl": {"een twee drie vier"},
    }
    out = tmp_path / "messages-1"
    [kept] = (out / "de").glob("*.txt")
    assert kept.name == f"{name('de', kept.read_text())[:16]}.txt"
