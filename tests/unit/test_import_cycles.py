"""No import cycle among the product's modules (router/, costmodel/), type-only imports
included: every import statement of a module counts, at module level, under
``if TYPE_CHECKING:`` or inside a function, since a cycle held apart by where an import sits is
still two modules that each need the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "costmodel")
# Known cycles, each to be removed by the work that owns it (the test fails once one is gone,
# so this list cannot go stale). None left: KVView is now a Protocol (router/kv/view.py) that
# the state's StateView (router/kv/snapshot.py) implements, reading the state through its own
# ViewSource protocol.
KNOWN: list[list[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``name`` imports (``from pkg import sub`` names the submodule)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_cycle_finder_sees_a_type_only_cycle(tmp_path):
    # a module pair tied only through TYPE_CHECKING is still a cycle; a chain is not
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert cycles(graph) == []
    graph["c"] = {"a"}
    assert cycles(graph) == [["a", "b", "c"]]
    mod = tmp_path / "m.py"
    mod.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router import x")
    assert _imports("router.m", mod, {"router.x"}) == {"router.x"}
    mod.write_text("def f():\n    from . import x\n    from .y import z\n")
    assert _imports("router.m", mod, {"router.x", "router.y"}) == {"router.x", "router.y"}


def test_router_and_costmodel_have_no_import_cycle():
    graph = import_graph()
    assert "router.proxy" in graph and "costmodel" in {m.split(".")[0] for m in graph}
    found = cycles(graph)
    new = [c for c in found if c not in KNOWN]
    assert new == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN if c not in found]
    assert gone == [], f"no longer a cycle, take it off KNOWN: {gone}"
