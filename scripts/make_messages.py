"""Translated program messages as the text recipe's folders, one per language: OUT/<language>/*.txt.

    python scripts/make_messages.py --out data/messages          # `make data/messages`

Short texts for language identification: the translations that the Debian packages installed on
this machine ship for their messages (/usr/share/locale/<language>/LC_MESSAGES/*.mo), nine
European languages, among them close pairs (Catalan and Spanish, Spanish and Portuguese, Danish
and Swedish, German and Dutch). Each message of --min_words words or more is one document, as
UTF-8 bytes. Left out: a catalog that cannot be read (bytes that are not of the character set it
names), and a message that more than one language has (often one left untranslated). Of a
language with more than --per_class messages, the first by a hash of the language's name and the
message are kept, so that the same machine gives the same folders. The recipe splits them itself
(val_fraction, by a hash of each document's bytes alone: had the messages been chosen by that
hash, every one kept would fall on the test side).
"""

import argparse
import gettext
import hashlib
import shutil
from collections import Counter
from pathlib import Path

LANGUAGES = ("ca", "da", "de", "es", "fr", "it", "nl", "pt", "sv")


def messages(folder):
    """The translated messages of a language's catalogs (folder: its LC_MESSAGES), each once."""
    found = set()
    for path in sorted(folder.glob("*.mo")) if folder.is_dir() else ():
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, IndexError):  # not its charset, not a catalog
            continue
        for source, text in catalog.items():
            if source and text and text != source:  # a translation, not the header
                found.add(text.strip())
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--locale", default="/usr/share/locale", help="the root, with <language>/ ...")
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--per_class", type=int, default=800, help="messages of a language at most")
    p.add_argument("--min_words", type=int, default=4, help="words of a message at least")
    p.add_argument("--languages", nargs="+", default=LANGUAGES, help="the locale's folder names")
    args = p.parse_args()
    found = {lang: messages(Path(args.locale) / lang / "LC_MESSAGES") for lang in args.languages}
    shared = Counter(text for texts in found.values() for text in texts)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    for lang, texts in found.items():
        kept = [t for t in texts if len(t.split()) >= args.min_words and shared[t] == 1]
        kept = sorted((hashlib.sha256(f"{lang}\n{t}".encode()).hexdigest(), t) for t in kept)
        for digest, text in kept[: args.per_class]:
            (out / lang).mkdir(parents=True, exist_ok=True)
            (out / lang / f"{digest[:16]}.txt").write_bytes(text.encode())
        print(f"{out}/{lang}: {min(len(kept), args.per_class)} messages")


if __name__ == "__main__":
    main()
