"""Router CPU per call as a count, not a time: user-space instructions of ``kvroute serve`` per
proxied call, under valgrind's callgrind.

The proxy benchmark's CPU times move by 15-20 % between runs on a shared machine. An
instruction count moves by about 0.5 %, so a change of a few per cent in kvroute's per-call work
shows. Set-up: the proxy benchmark's backend (:mod:`loadtest.bench.bench_proxy`); the router
(``round_robin``, that one replica) under ``valgrind --tool=callgrind --instr-atstart=no``;
100 warm-up calls not counted; then counting on (``callgrind_control -i on``) for N calls at
c = 8, and off again. The count is divided by the calls. The event loop's own timers during
those seconds are included; kernel work (system calls, copies in the kernel) is not.

Rows, per mode (``json``: a 2 KB request and a 230-byte answer; ``json_resp``: a 2 KB request
and a 200 KB answer), with no session header (the identity is the prompt-prefix hash):

* ``kvroute`` — this tree;
* ``baseline`` — with ``KVROUTE_BENCH_INSTR_BASELINE=DIR``, the router of another checkout
  (``git worktree add /tmp/kvbase <commit> --detach``);
* ``bare`` — the same aiohttp server and kvroute's upstream client with no routing, no session
  table and no metrics: the floor of this design, so ``kvroute - bare`` is kvroute's own work.

Needs valgrind (Debian ``valgrind``); without it the rows say so.

    python -m loadtest.benchmarks --only instructions [--quick]
    KVROUTE_BENCH_INSTR_BASELINE=/tmp/kvbase python -m loadtest.bench.bench_instructions
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.bench import bench_proxy as bp

WARMUP = 100
CONCURRENCY = 8


def bare_main(port: int, backend: str) -> None:
    """The floor: read the body, send it upstream with kvroute's client, answer what came."""
    import aiohttp
    import uvloop
    from aiohttp import web
    from multidict import CIMultiDict

    from router.upstream import Upstream

    async def main() -> None:
        up = Upstream(aiohttp.ClientSession(), limit=0, limit_per_host=0,
                      connect_timeout_s=5, read_timeout_s=60)  # fmt: skip

        async def chat(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            headers = CIMultiDict({"Content-Type": "application/json"})
            r = await up.request("POST", backend, "/v1/chat/completions", headers, raw)
            try:
                body = await r.read()
                return web.Response(status=r.status, body=body, content_type="application/json")
            finally:
                r.release()

        async def ready(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/ready", ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _count(argv: list[str], cwd: str | None, body: bytes, n: int, work: Path, tag: str) -> int:
    out = work / f"callgrind.{tag}.out"
    port = bp._free_port()
    vg = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
          "--instr-atstart=no"]  # fmt: skip
    p = bp._spawn(vg + argv + ["--port", str(port)], work / f"{tag}.log", cwd=cwd)
    try:
        url = f"http://127.0.0.1:{port}"
        bp._wait_http(url + "/ready", proc=p, timeout=600)
        asyncio.run(bp._load(url, body, CONCURRENCY, WARMUP))
        subprocess.run(["callgrind_control", "-i", "on", str(p.pid)], check=True,
                       capture_output=True)  # fmt: skip
        res = asyncio.run(bp._load(url, body, CONCURRENCY, n))
        subprocess.run(["callgrind_control", "-i", "off", str(p.pid)], check=True,
                       capture_output=True)  # fmt: skip
        if res["errors"]:
            raise RuntimeError(f"{res['errors']} calls failed")
        calls = res["n"] + res["warmup_calls"]  # _load's own warm-up calls were counted too
    finally:
        bp._stop(p)  # callgrind writes its totals at exit
    m = re.search(r"^totals:\s+(\d+)", out.read_text(errors="replace"), re.M)
    if m is None:
        raise RuntimeError(f"no callgrind totals in {out}")
    return round(int(m.group(1)) / calls)


def run(quick: bool = False) -> list[dict[str, Any]]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return [{"name": "instructions", "error": "valgrind not installed (Debian valgrind)"}]
    n = 300 if quick else 2000
    work = Path(tempfile.mkdtemp(prefix="kvroute-bench-instr-"))
    backend = None
    rows: list[dict[str, Any]] = []
    try:
        bport = bp._free_port()
        backend = bp._spawn(
            [sys.executable, "-m", "loadtest.bench.bench_proxy", "--backend", str(bport)],
            work / "backend.log",
        )
        burl = f"http://127.0.0.1:{bport}"
        bp._wait_http(burl + "/health", proc=backend)
        serve = [sys.executable, "-m", "router.serve", "--replica", burl, "--policy", "round_robin",
                 "--log-level", "warning", "--max-body-bytes", str(64 << 20)]  # fmt: skip
        trees: list[tuple[str, list[str], str | None]] = [("kvroute", serve, None)]
        baseline = os.environ.get("KVROUTE_BENCH_INSTR_BASELINE")
        if baseline:
            trees.append(("baseline", serve, baseline))
        trees.append(("bare", [sys.executable, "-m", "loadtest.bench.bench_instructions",
                               "--bare", burl], None))  # fmt: skip
        for mode, body in (
            ("json", bp._body(2_000, stream=False)),
            ("json_resp", bp._body(2_000, stream=False, max_tokens=200_000)),
        ):
            counts: dict[str, int] = {}
            for name, argv, cwd in trees:
                row: dict[str, Any] = {"name": f"{mode}_{name}", "mode": mode, "calls": n}
                try:
                    counts[name] = _count(argv, cwd, body, n, work, row["name"])
                    row["instructions_per_call"] = counts[name]
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    row["error"] = repr(e)
                rows.append(row)
            if "kvroute" in counts and "bare" in counts:
                own = counts["kvroute"] - counts["bare"]
                rows.append({"name": f"{mode}_kvroute_own", "mode": mode,
                             "instructions_per_call": own})  # fmt: skip
    finally:
        if backend is not None:
            bp._stop(backend)
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:  # --bare BACKEND_URL --port PORT
        bare_main(int(sys.argv[4]), sys.argv[2])
    else:
        for r in run(quick="--quick" in sys.argv):
            print(r)
