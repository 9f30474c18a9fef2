"""Every link between the README and the pages of docs/ leads somewhere: the file exists, and a
heading makes the anchor (as GitHub makes it from the heading's text). Pages move: the figures
of "Learning your classes" left docs/unet.md for docs/learning.md, and the links into them
with them."""

import re

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def anchors(text):
    """The anchors GitHub gives the headings of a Markdown page: lower case, punctuation but - and
    _ dropped, spaces as -, and -1, -2 after a repeated one. Lines in code blocks are no
    headings."""
    found, seen, in_code = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_anchors_are_made_as_github_makes_them():
    heading = "## Where issue 46's goals stand\n"
    page = "# Look before you train: `--check_data`\n```\n# not a heading\n```\n" + heading * 2
    assert anchors(page) == {
        "look-before-you-train---check_data",
        "where-issue-46s-goals-stand",
        "where-issue-46s-goals-stand-1",
    }


def test_every_link_between_the_pages_leads_to_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
