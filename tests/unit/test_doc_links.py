"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's heading ids: lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` … for repeats). Code blocks and inline code are skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path.read_text(encoding="utf-8")):
        out.update(re.findall(r'<a id="([^"]+)"></a>', line))  # explicit anchors
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in _prose(path.read_text(encoding="utf-8")):
        prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for m in LINK.finditer(prose):
            # the target itself may hold backticks blanked above: read it from the line
            target = line[m.start(1) : m.end(1)]
            out.append((n, target))
    return out


def broken(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no such heading in {dest.relative_to(root)})")
    return bad


def test_slug_follows_github() -> None:
    assert slug("Non-streamed calls and `--workers` (issue 13)") == (
        "non-streamed-calls-and---workers-issue-13"
    )
    assert slug("Simulator: 64 × H200 × 1 hour (`loadtest/bench/bench_twin.py`)") == (
        "simulator-64--h200--1-hour-loadtestbenchbench_twinpy"
    )
    assert slug("See [the log](log.md) now") == "see-the-log-now"


def test_the_checker_finds_a_broken_file_and_anchor(tmp_path: Path) -> None:
    """The check itself can fail: a missing file, a missing heading, a heading only inside a
    code block, and a repeated heading's second id."""
    (tmp_path / "a.md").write_text(
        "# Top\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n"
        "[ok](#twice-1) [gone](b.md) [bad](#not-a-heading) [x](#top) `[code](nowhere.md)`\n",
        encoding="utf-8",
    )
    assert broken(tmp_path / "a.md", root=tmp_path) == [
        "a.md:10: b.md (no such file)",
        "a.md:10: #not-a-heading (no such heading in a.md)",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_resolve(path: Path) -> None:
    assert broken(path) == []
