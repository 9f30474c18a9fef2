"""The one report writer of the bench: every mode ends in write_report()."""

import json
from pathlib import Path


def rate(samples_per_s):
    """Samples/s as printed: whole numbers, with a decimal below 100 (a U-Net on a CPU)."""
    return f"{samples_per_s:.0f}" if samples_per_s >= 100 else f"{samples_per_s:.1f}"


def write_report(path, report, header, rows, notes):
    """Print the table (header, then rows of cells; the first and last columns left-aligned, the
    others right-aligned) and the notes below it; write `report` as JSON to `path`, and the table
    and notes as markdown beside it (the same name, .md)."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    last = len(header) - 1

    def line(row):
        return " ".join(
            c.ljust(w) if i in (0, last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    print("\n" + "\n".join(line(row) for row in cells))
    for note in notes:
        print(note)
    markdown = [f"| {' | '.join(row)} |" for row in cells]
    markdown.insert(1, "|" + " --- |" * len(header))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text("\n".join(markdown + [""] + notes) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")
