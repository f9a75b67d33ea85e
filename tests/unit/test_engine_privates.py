"""Every vLLM private the engine plugin touches is listed in engine_patches/privates.py.

A static scan of engine_patches/ finds: underscore attributes reached on objects that are not
the plugin's own (its own classes, its own module-level names and ``_kvroute*`` attributes
are not vLLM's), underscore names given as strings (``getattr(x, "_y")``, the namespace of a
class built with ``type()``: a private method overridden), private vLLM modules and names
imported or named (``"vllm._custom_ops"``), and ``__class__`` swaps. Each must have an entry
for its file; each entry must still be used; the table in docs/engine.md is the list's.
The vllm tier (tests/vllm/test_engine_privates.py) checks each entry against vLLM itself.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

from engine_patches import kernel_patches, privates

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for p in (ROOT / "engine_patches").glob("*.py") if p.name != "privates.py")
PRIVATE = re.compile(r"^_(?!_)(?!kvroute)[A-Za-z]\w*$")


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_member(node: ast.Attribute, parents: dict[ast.AST, ast.AST], from_vllm: set[str]) -> bool:
    """``self._x`` in a class of ours: its own state, or a method it defines."""
    cls: ast.AST = node
    while cls in parents and not isinstance(cls, ast.ClassDef):
        cls = parents[cls]
    if not isinstance(cls, ast.ClassDef) or _root_name(node.value) not in ("self", "cls"):
        return False
    if not any(_root_name(b) in from_vllm for b in cls.bases):
        return True  # not a vLLM subclass: every underscore name is ours
    return node.attr in {m.name for m in cls.body if isinstance(m, ast.FunctionDef)}


def _names_an_attribute(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    """A string that names an attribute: ``getattr(x, "_y")`` and its kin, a key of the
    namespace given to ``type()`` (a dict with ``"__module__"``: a method overridden), or a
    path element of a kernel patch ``Target``."""
    parent = parents.get(node)
    if isinstance(parent, ast.Tuple):
        parent = parents.get(parent)
    if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
        name = parent.func.id
        return name == "Target" or (
            name in ("getattr", "hasattr", "setattr", "delattr") and parent.args[1:2] == [node]
        )
    if isinstance(parent, ast.Dict) and node in parent.keys:
        keys = [k.value for k in parent.keys if isinstance(k, ast.Constant)]
        return "__module__" in keys
    return False


def private_uses(files: list[Path]) -> list[tuple[str, str, int]]:
    """(file name, symbol, line) of every vLLM private the files reach."""
    trees = {p: ast.parse(p.read_text()) for p in files}
    own: set[str] = set()  # module-level names of the scanned files (theirs, not vLLM's)
    for tree in trees.values():
        for stmt in tree.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(stmt.name)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                own |= {t.id for t in targets if isinstance(t, ast.Name)}
    uses: list[tuple[str, str, int]] = []
    for path, tree in trees.items():
        parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
        from_vllm: set[str] = set()  # names bound to vLLM modules or classes in this file
        own_modules: set[str] = set()  # names bound to engine_patches modules in this file
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module == "engine_patches":
                own_modules |= {a.asname or a.name for a in n.names}
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm":
                from_vllm |= {a.asname or a.name for a in n.names}
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == "vllm":
                        from_vllm.add(a.asname or "vllm")

        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                parent = parents.get(n)
                if n.attr == "__class__" and isinstance(parent, ast.Assign) and n in parent.targets:
                    uses.append((path.name, "__class__", n.lineno))
                elif (
                    PRIVATE.match(n.attr)
                    and not (_root_name(n) in own_modules and n.attr in own)
                    and not _own_member(n, parents, from_vllm)
                ):
                    uses.append((path.name, n.attr, n.lineno))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                if n.value.startswith("vllm."):
                    segs = [s for s in n.value.split(".") if PRIVATE.match(s)]
                    uses += [(path.name, s, n.lineno) for s in segs]
                elif PRIVATE.match(n.value) and _names_an_attribute(n, parents):
                    uses.append((path.name, n.value, n.lineno))
            elif isinstance(n, ast.Import | ast.ImportFrom):
                if isinstance(n, ast.Import):
                    names = [
                        s for a in n.names if a.name.startswith("vllm") for s in a.name.split(".")
                    ]
                elif (n.module or "").split(".")[0] == "vllm":
                    names = [*(n.module or "").split("."), *(a.name for a in n.names)]
                else:
                    names = []
                uses += [(path.name, s, n.lineno) for s in names if PRIVATE.match(s)]
    return uses


def listed(file: str, symbol: str) -> bool:
    """A vLLM private with an entry, or the plugin's own state on a vLLM subclass."""
    return any(
        p.file == file and (p.symbol == symbol or symbol in p.owner.split("."))
        for p in privates.PRIVATES
    ) or any(o.file == file and symbol in o.names for o in privates.OWN_STATE)


def test_every_private_the_plugin_reaches_is_listed() -> None:
    missing = sorted({(f, s) for f, s, _ in private_uses(SOURCES) if not listed(f, s)})
    assert not missing, f"add these to engine_patches/privates.py: {missing}"


def test_every_class_swap_is_listed_once() -> None:
    swaps = Counter(f for f, s, _ in private_uses(SOURCES) if s == "__class__")
    entries = Counter(p.file for p in privates.PRIVATES if p.symbol == "__class__")
    assert swaps == entries
    assert swaps["writeback.py"] == 2  # the scheduler manager and the worker handler


def test_every_entry_is_still_used_and_complete() -> None:
    for p in privates.PRIVATES:
        text = (ROOT / "engine_patches" / p.file).read_text()
        assert p.symbol in text or p.owner in text, f"{p.file} no longer touches {p.symbol}"
        assert p.owner.startswith("vllm"), p
        assert p.why and p.public and p.use, p
        assert set(p.versions) <= {"0.32.0", "0.33.0"}, p
    for o in privates.OWN_STATE:
        text = (ROOT / "engine_patches" / o.file).read_text()
        assert o.owner.rsplit(".", 1)[1] in text, o
        assert all(f"self.{name}" in text for name in o.names), o


def test_every_kernel_patch_target_is_listed() -> None:
    for t in kernel_patches.TARGETS:
        owner = ".".join((t.module, *t.path[:-1]))
        assert any(p.owner == owner and p.symbol == t.path[-1] for p in privates.PRIVATES), (
            f"{t.module}.{'.'.join(t.path)}"
        )


def test_docs_carry_the_list() -> None:
    assert privates.markdown() in (ROOT / "docs" / "engine.md").read_text(), (
        "docs/engine.md is out of date: paste `python -m engine_patches.privates`"
    )


def test_the_scan_finds_each_kind_of_use(tmp_path: Path) -> None:
    """The scan itself: what it must find, and the plugin's own names it must not."""
    src = tmp_path / "mod.py"
    src.write_text(
        "from vllm.v1.x import Base, _hidden\n"
        "import vllm._ops as ops\n"
        "def _helper(): ...\n"
        "class Ours:\n"
        "    def __init__(self): self._mine = 1\n"
        "class Sub(Base):\n"
        "    def __init__(self): self._kvroute_x = 1; self._theirs = 2; self._m()\n"
        "    def _m(self): ...\n"
        "def build(mgr, base):\n"
        "    mgr.__class__ = Ours\n"
        "    base._method(mgr)\n"
        "    getattr(mgr, '_by_name', None)\n"
        "    mgr.path.rpartition('_g')\n"
        "    _helper()\n"
        "    mgr._kvroute_flag = True\n"
        "    return {'_override': 1, '__module__': __name__, 'x': 'vllm._mod.fn'}\n"
    )
    found = {s for _, s, _ in private_uses([src])}
    assert found == {
        "_hidden", "_ops", "_theirs", "__class__", "_method", "_by_name", "_override", "_mod",
    }  # fmt: skip
