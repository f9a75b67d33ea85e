"""The border between the product and its harness (issue 41).

The router's distribution (``kvroute``: router, costmodel, engine_patches, kernels and the CLI)
carries no ``loadtest``; the harness is its own distribution (``kvroute-harness``,
loadtest/pyproject.toml). ``kvroute serve`` and ``kvroute engine`` run with ``loadtest``
unimportable; the harness commands then answer with one line saying how to install it. The
wheels are built for real (``pip wheel``, no index, no build isolation) from a copy of the tree.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import kvroute
from kvroute import cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kvroute", "router", "costmodel", "engine_patches", "kernels")
HARNESS_COMMANDS = sorted(n for n, (m, _) in cli.COMMANDS.items() if m.startswith("loadtest."))

# Runs the CLI with ``loadtest`` unimportable, as on a host with only the router installed:
# a finder ahead of all others refuses the package and everything under it.
WITHOUT_HARNESS = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "loadtest" or name.startswith("loadtest."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from kvroute.cli import main
try:
    code = main(sys.argv[1:])
finally:  # --help exits from inside argparse
    leaked = sorted(m for m in sys.modules if m == "loadtest" or m.startswith("loadtest."))
    print("LOADTEST_MODULES", leaked, file=sys.stderr)
sys.exit(code)
"""


def run_without_harness(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_HARNESS, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def build_wheel(src: Path, out: Path) -> list[str]:
    """Build ``src`` into a wheel under ``out`` (pip, offline) and return its file names."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = out.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the two builds read (the harness included, so leaving it out is the
    router build's doing), away from the clone so no build/ or egg-info lands in it."""
    dst = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for name in (*PRODUCT, "loadtest"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    return dst


def py_files(folder: Path) -> set[str]:
    return {
        p.relative_to(folder.parent).as_posix()
        for p in folder.rglob("*.py")
        if "__pycache__" not in p.parts and "build" not in p.parts
    }


def test_the_router_wheel_carries_the_product_and_no_harness(tree: Path, tmp_path: Path) -> None:
    names = build_wheel(tree, tmp_path)
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == set(PRODUCT), tops
    assert not [n for n in names if n.startswith("loadtest/")]
    assert not [n for n in names if n.startswith("kernels/") and "bench" in n]
    for package in PRODUCT:  # every module of the product, none left behind
        assert py_files(ROOT / package) <= set(names), package
    assert any(n.startswith("costmodel/profiles/") and n.endswith(".yaml") for n in names)
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(next(tmp_path.glob("*.whl"))) as whl:
        text = whl.read(entry_points).decode()
    assert "kvroute = kvroute.cli:main" in text
    assert "engine_patches.plugin:register" in text


def test_the_harness_wheel_carries_all_of_loadtest_and_nothing_else(
    tree: Path, tmp_path: Path
) -> None:
    names = build_wheel(tree / "loadtest", tmp_path)
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"loadtest"}, tops
    # every module (a subpackage missing from loadtest/pyproject.toml's list fails here)
    missing = py_files(ROOT / "loadtest") - set(names)
    assert not missing, f"not in the harness wheel (add the package to its list): {missing}"
    assert "loadtest/kernel_tools/gpu_session.sh" in names
    data = {p.name for p in (ROOT / "loadtest" / "data").iterdir() if p.is_file()}
    assert {f"loadtest/data/{d}" for d in data} <= set(names)


def test_the_two_distributions_agree_on_the_version() -> None:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    harness = tomllib.loads((ROOT / "loadtest" / "pyproject.toml").read_text())
    v = kvroute.__version__
    assert harness["project"]["version"] == v
    assert f"kvroute=={v}" in harness["project"]["dependencies"]
    assert root["project"]["optional-dependencies"]["harness"] == [f"kvroute-harness=={v}"]
    assert "kvroute[harness]" in root["project"]["optional-dependencies"]["dev"]


@pytest.mark.parametrize(
    "argv",
    [["serve", "--help"], ["engine", "flags", "--json"], ["engine", "versions"], ["--help"]],
)
def test_product_commands_run_without_the_harness(argv: list[str]) -> None:
    done = run_without_harness(*argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADTEST_MODULES []" in done.stderr
    if argv[0] == "serve":
        assert done.stdout.startswith("usage: kvroute serve")
    elif argv[:2] == ["engine", "flags"]:
        assert "--enable-prefix-caching" in json.loads(done.stdout)
    elif argv[0] == "--help":
        assert "[harness not installed]" in " ".join(done.stdout.split())


@pytest.mark.parametrize("command", HARNESS_COMMANDS)
def test_harness_commands_without_the_harness_say_how_to_install_it(command: str) -> None:
    done = run_without_harness(command, "--some-flag", "x")
    assert done.returncode == 2
    [line] = [ln for ln in done.stderr.splitlines() if not ln.startswith("LOADTEST_MODULES")]
    assert line.startswith(f"kvroute {command}: needs the kvroute harness")
    assert "pip install 'kvroute[harness]'" in line and "pip install -e ./loadtest" in line


def test_harness_commands_are_the_seven_loadtest_ones() -> None:
    assert HARNESS_COMMANDS == ["bench", "cluster", "demo", "model", "replay", "sim", "twin"]
    assert {n for n, (m, _) in cli.COMMANDS.items() if n not in HARNESS_COMMANDS} == {
        "serve",
        "engine",
    }


def test_a_missing_module_of_ours_is_an_error_not_an_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "twin", ("loadtest.no_such_module", "x"))
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.build_parser()


def test_a_library_only_the_harness_needs_gets_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cli.importlib.import_module

    def fake(name: str) -> object:
        if name == "loadtest.replay.cli":
            raise ModuleNotFoundError("No module named 'rich'", name="rich")
        return real(name)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["replay", "--target", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvroute replay: needs the kvroute harness") and "'rich'" in err


def imports_of(folder: Path) -> dict[str, set[str]]:
    """file -> top-level packages it imports (type-only imports included)."""
    out: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops.add(node.module.split(".")[0])
        out[path.relative_to(ROOT).as_posix()] = tops
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("kvroute", {"loadtest"}),
        ("router", {"loadtest", "engine_patches", "kernels", "torch", "vllm"}),
        ("costmodel", {"loadtest", "router", "engine_patches", "kernels"}),
        ("engine_patches", {"loadtest", "router"}),
        ("kernels", {"loadtest", "engine_patches", "router"}),  # engine_patches -> kernels
    ],
)
def test_the_product_never_imports_the_harness(package: str, forbidden: set[str]) -> None:
    bad = {f: sorted(t & forbidden) for f, t in imports_of(ROOT / package).items() if t & forbidden}
    assert not bad, bad


def test_an_unknown_flag_of_a_product_command_is_still_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["engine", "versions", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
