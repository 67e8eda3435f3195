"""The documentation lives in the repository and its cross-references hold.

- no text file cites the internal notes that docs/algorithms.md and docs/design.md replaced;
- every "docs/algorithms.md section N" citation names a section that exists (and "docs/design.md, <section>"
  or "docs/design.md, convention N" one of that page's);
- every relative Markdown link in README.md and docs/*.md reaches a file, and its #anchor, if any, a heading there.

    python -m pytest tests/test_docs.py -q
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".toml", ".sh")
# Spelled in pieces so that this file does not mention them itself.
STALE_REFERENCES = ("ALGORITHMS" + ".md", "DESIGN" + ".md", "../" + "shared")

# "docs/algorithms.md section 4", "docs/algorithms.md sections 2, 3, 7-9", "[algorithms.md sections 7 and 8](...)"
_NUMBER = r"\d+(?:\s*[-–]\s*\d+)?"
ALGORITHMS_CITATION = re.compile(rf"algorithms\.md\s+sections?\s+({_NUMBER}(?:\s*(?:,|and)\s*{_NUMBER})*)")
# "docs/design.md, Layout", "docs/design.md, convention 8"
DESIGN_CITATION = re.compile(r"design\.md, (?:convention (\d+)|([A-Z]\w+))")
MD_LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#([^)\s]*))?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


@functools.cache
def text_files() -> dict[str, str]:
    """Path -> contents of every text file git tracks or would track (untracked files that are not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    out = {}
    for name in sorted(set(listed)):
        path = ROOT / name
        if (name.endswith(TEXT_SUFFIXES) or path.name == "Makefile") and path.is_file():
            out[name] = path.read_text(encoding="utf-8")
    return out


def headings(markdown: str) -> list[str]:
    """The heading texts of a Markdown page, code blocks left out."""
    return re.findall(r"^#{1,6}\s+(.+?)\s*$", FENCE.sub("", markdown), re.M)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for text in headings(markdown):
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def cited_numbers(listing: str) -> list[int]:
    """``"2, 3, 7-9"`` -> ``[2, 3, 7, 8, 9]``."""
    numbers = []
    for first, last in re.findall(r"(\d+)(?:\s*[-–]\s*(\d+))?", listing):
        numbers += range(int(first), int(last or first) + 1)
    return numbers


def test_nothing_cites_notes_outside_the_repository():
    stale = [
        f"{name}:{number}: {line.strip()}"
        for name, text in text_files().items()
        for number, line in enumerate(text.splitlines(), start=1)
        if any(ref in line for ref in STALE_REFERENCES)
    ]
    assert not stale, "cite docs/algorithms.md or docs/design.md instead:\n" + "\n".join(stale)


def algorithm_sections() -> list[int]:
    """The N of every "## N. Title" heading of docs/algorithms.md, in page order."""
    page = FENCE.sub("", (DOCS / "algorithms.md").read_text(encoding="utf-8"))
    return [int(n) for n in re.findall(r"^## (\d+)\. ", page, re.M)]


def test_algorithms_page_keeps_sections_1_to_10():
    assert algorithm_sections() == list(range(1, 11))


def test_algorithms_citations_name_existing_sections():
    sections = set(algorithm_sections())
    bad, cited = [], 0
    for name, text in text_files().items():
        for match in ALGORITHMS_CITATION.finditer(text):
            for n in cited_numbers(match.group(1)):
                cited += 1
                if n not in sections:
                    bad.append(f"{name}:{line_of(text, match.start())}: section {n}")
    assert cited, "no citation found: has the citation form changed?"
    assert not bad, "docs/algorithms.md has no such section:\n" + "\n".join(bad)


def test_design_citations_name_existing_sections():
    page = (DOCS / "design.md").read_text(encoding="utf-8")
    sections = {h.split()[0] for h in headings(page)}
    conventions = FENCE.sub("", page).split("## Conventions", 1)[1]
    bad = []
    for name, text in text_files().items():
        for match in DESIGN_CITATION.finditer(text):
            number, section = match.groups()
            ok = re.search(rf"^{number}\. ", conventions, re.M) if number else section in sections
            if not ok:
                bad.append(f"{name}:{line_of(text, match.start())}: {match.group(0)}")
    assert not bad, "docs/design.md has no such section or convention:\n" + "\n".join(bad)


def test_relative_markdown_links_resolve():
    pages = ["README.md"] + [name for name in text_files() if name.startswith("docs/") and name.endswith(".md")]
    bad = []
    for name in pages:
        text = (ROOT / name).read_text(encoding="utf-8")
        for match in MD_LINK.finditer(text):
            target, anchor = match.groups()
            if "://" in target:
                continue
            path = (ROOT / name).parent / target
            where = f"{name}:{line_of(text, match.start())}: {match.group(0)}"
            if not path.is_file():
                bad.append(f"{where} (no such file)")
            elif anchor and anchor not in anchors(path.read_text(encoding="utf-8")):
                bad.append(f"{where} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)
