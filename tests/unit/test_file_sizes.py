"""No Python file in ``router/`` or ``loadtest/twin/`` is over 500 lines (issue 41): a module
that grows past that is usually doing two jobs (STYLE.md), so the limit is checked here rather
than left to review."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("router", "loadtest/twin")
MAX_LINES = 500


def oversized(root: Path, folders: tuple[str, ...], limit: int) -> list[str]:
    """``"path: N lines"`` for each ``.py`` file under ``folders`` with more than ``limit``
    lines (counted as ``wc -l`` does: newline characters), sorted by path."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            n = path.read_bytes().count(b"\n")
            if n > limit:
                out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def test_no_file_over_the_limit() -> None:
    big = oversized(ROOT, CHECKED, MAX_LINES)
    assert not big, f"over {MAX_LINES} lines, split along the jobs each does: " + ", ".join(big)


def test_the_check_finds_an_oversized_file(tmp_path: Path) -> None:
    (tmp_path / "router" / "sub").mkdir(parents=True)
    (tmp_path / "router" / "small.py").write_text("x = 1\n" * 500)
    (tmp_path / "router" / "sub" / "big.py").write_text("x = 1\n" * 501)
    (tmp_path / "router" / "notes.txt").write_text("x\n" * 900)  # only Python files count
    assert oversized(tmp_path, ("router",), 500) == ["router/sub/big.py: 501 lines"]
