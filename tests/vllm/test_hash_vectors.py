"""The committed golden hash vectors are still exactly what vLLM's own code computes."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from loadtest.vllmbed import vllm_python

ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(120)
def test_golden_vectors_match_installed_vllm():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run(
        [str(vllm_python()), str(ROOT / "scripts" / "gen_hash_vectors.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
        check=True,
    ).stdout
    committed = json.loads((ROOT / "tests/unit/data/vllm_hash_vectors.json").read_text())
    assert json.loads(out) == committed
