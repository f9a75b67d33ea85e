"""Proxy overhead: client -> {direct | kvroute serve | sglang-router} -> one fast backend.

Each row: mode (``sse``: a chat completion with ``stream: true``; ``json``: ``stream: false``
with a 230-byte answer; ``json_resp``: ``stream: false``, a 2 KB request and an answer of the
row's size), body size (2 KB, 200 KB: the request's, or for ``json_resp`` the response's),
client concurrency (1, 32), path; throughput (req/s), median and p90 latency, the proxy process's
CPU per request (user+sys from ``/proc/<pid>/stat``) and ratios against direct and against
sglang-router measured in the same run. The backend is a small aiohttp server in its own
process that reads the whole body and streams 8 SSE events back; the load generator is this
process. All three share this machine's cores, so read the ratios, not absolute numbers; the
paths take turns over three rounds per case and each row is the median round.

sglang-router (PyPI ``sglang-router``, Rust) comes from ``make bench-peers`` (a venv
under ``$KVROUTE_CACHE``); when it is missing its rows say so instead of failing the run.
Both routers run ``round_robin`` over the one backend; kvroute also runs its default
``session_affinity`` policy (a session table write per call) and sglang-router its default
``cache_aware`` (an approximate radix tree over the request text).

    python -m loadtest.benchmarks --only proxy [--quick]
    KVROUTE_BENCH_PROXY_MODES=json,json_resp python -m loadtest.bench.bench_proxy
    KVROUTE_BENCH_PROXY_WORKERS=2 ...     # adds kvroute round_robin with --workers 2
    KVROUTE_BENCH_PROXY_BASELINE=DIR ...  # adds kvroute round_robin from another checkout
    python -m loadtest.bench.bench_proxy --backend PORT     # the backend alone
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
N_EVENTS = 8
COMPLETION = (
    b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"tok tok tok tok tok tok tok tok"},'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":8}}'
)


def _cache() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE", Path.home() / ".cache" / "kvroute"))


def sglang_python() -> Path | None:
    for p in sorted(_cache().glob("peers-sglang-router-*")):
        if (p / ".ready").exists():
            return p / "bin" / "python"
    return None


# --- backend (runs in its own process) ---------------------------------------------------


def completion(size: int) -> bytes:
    """A JSON chat completion of about ``size`` bytes (at least :data:`COMPLETION`'s)."""
    pad = max(0, size - len(COMPLETION))
    return COMPLETION.replace(b"tok tok", b"tok " + b"x" * pad + b" tok", 1)


def backend_main(port: int) -> None:
    import orjson
    from aiohttp import web

    sized: dict[int, bytes] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b'"stream":false' in raw[:200]:
            # max_tokens above 8 asks for an answer of that many bytes (json_resp mode); a
            # field every router forwards as it is
            want = int(orjson.loads(raw).get("max_tokens", 8))
            if want <= N_EVENTS:
                return web.Response(body=COMPLETION, content_type="application/json")
            if want not in sized:
                sized[want] = completion(want)
            return web.Response(body=sized[want], content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(N_EVENTS):
            await resp.write(SSE_EVENT)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def info(request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True, "dp_size": 1}
        )

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    for path in ("/health", "/health_generate", "/metrics"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", info)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/model_info", info)
    app.router.add_get("/server_info", info)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- processes -------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(
    url: str,
    timeout: float = 60.0,
    proc: subprocess.Popen[bytes] | None = None,
    ok_codes: tuple[int, ...] = (200,),
) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code in ok_codes:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout} s")


def _spawn(argv: list[str], log: Path, cwd: str | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _cpu_s(pid: int) -> float:
    """User+sys CPU seconds of ``pid`` and its live children (``serve --workers``' workers)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for kid in kids:
        try:
            total += _cpu_s(int(kid))
        except (OSError, IndexError, ValueError):
            pass  # exited meanwhile
    return total


# --- load ----------------------------------------------------------------------------


async def _load(
    url: str, body: bytes, concurrency: int, n: int, pid: int | None = None
) -> dict[str, float]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    todo = iter(range(n))
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal errors
            for _ in todo:
                t0 = time.perf_counter()
                try:
                    async with s.post(
                        url + "/v1/chat/completions", data=body, headers=headers
                    ) as r:
                        data = await r.read()
                        if r.status != 200 or not data.endswith((b"[DONE]\n\n", b"}}")):
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1
                lat.append(time.perf_counter() - t0)

        # warm-up: connections and code paths
        n_warm = min(n // 10, 50)
        warm = iter(range(n_warm))
        todo, main = warm, todo
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        lat.clear()
        errors = 0
        todo = main
        cpu0 = _cpu_s(pid) if pid else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = _cpu_s(pid) - cpu0 if pid else None
    lat.sort()
    out = {
        "rps": len(lat) / wall,
        "p50_ms": statistics.median(lat) * 1e3,
        "p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3,
        "errors": errors,
        "n": len(lat),
        "warmup_calls": n_warm,  # sent before the measured calls (the proxy's CPU counts them)
        "wall_s": wall,
    }
    if cpu is not None:
        out["cpu_ms_per_req"] = cpu * 1e3 / len(lat)
    return out


def _body(size: int, stream: bool = True, max_tokens: int = N_EVENTS) -> bytes:
    import orjson

    system: dict[str, str] = {"role": "system", "content": ""}
    base: dict[str, Any] = {
        "stream": stream,
        "model": "tiny",
        "max_tokens": max_tokens,
        "messages": [system, {"role": "user", "content": "hello"}],
    }
    pad = size - len(orjson.dumps(base))
    system["content"] = ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
    out = orjson.dumps(base)
    assert abs(len(out) - size) <= 1
    return out


ROUNDS = 3


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The round with the median throughput; errors and n summed over all rounds."""
    med = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]
    return {**med, "errors": sum(r["errors"] for r in runs), "n": sum(r["n"] for r in runs)}


def run(quick: bool = False) -> list[dict[str, Any]]:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="kvroute-bench-proxy-"))
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    try:
        bport = _free_port()
        backend = _spawn(
            [sys.executable, "-m", "loadtest.bench.bench_proxy", "--backend", str(bport)],
            work / "backend.log",
        )
        procs.append(backend)
        burl = f"http://127.0.0.1:{bport}"
        _wait_http(burl + "/health", proc=backend)

        paths: dict[str, tuple[str, int | None]] = {"direct": (burl, None)}
        # KVROUTE_BENCH_PROXY_WORKERS=2: also kvroute round_robin with ``--workers 2``
        workers = int(os.environ.get("KVROUTE_BENCH_PROXY_WORKERS", "1"))
        kv_paths: list[tuple[str, int, str | None]] = [
            ("round_robin", 1, None), ("session_affinity", 1, None)
        ]  # fmt: skip
        if workers > 1:
            kv_paths.append(("round_robin", workers, None))
        # KVROUTE_BENCH_PROXY_BASELINE=DIR: also kvroute round_robin served from another
        # checkout (a before/after in one run, on the same machine load)
        baseline = os.environ.get("KVROUTE_BENCH_PROXY_BASELINE")
        if baseline:
            kv_paths.append(("round_robin", 1, baseline))
        for policy, nproc, tree in kv_paths:
            port = _free_port()
            p = _spawn(
                [
                    sys.executable,
                    "-m",
                    "router.serve",
                    "--port",
                    str(port),
                    "--replica",
                    burl,
                    "--policy",
                    policy,
                    "--log-level",
                    "warning",
                    "--max-body-bytes",
                    str(64 << 20),
                    "--workers",
                    str(nproc),
                ],
                work / f"kvroute-{policy}-w{nproc}{'-baseline' if tree else ''}.log",
                cwd=tree,
            )
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url + "/ready", proc=p)
            name = f"kvroute:{policy}" + (f":w{nproc}" if nproc > 1 else "")
            paths[name + (":baseline" if tree else "")] = (url, p.pid)
        sg = sglang_python()
        if sg is None:
            rows.append({"name": "sglang-router", "error": "not installed: run `make bench-peers`"})
        for policy in ("round_robin", "cache_aware") if sg is not None else ():
            port = _free_port()
            log = work / f"sglang-router-{policy}.log"
            argv = [str(sg), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--worker-urls", burl, "--policy", policy,
                    "--log-level", "warn", "--max-payload-size", str(64 << 20),
                    "--disable-retries", "--disable-circuit-breaker",
                    # its metrics exporter defaults to a fixed port on all interfaces
                    "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(_free_port())]  # fmt: skip
            p = _spawn(argv, log)
            procs.append(p)
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http(url + "/health", timeout=90, proc=p, ok_codes=(200,))
                paths[f"sglang-router:{policy}"] = (url, p.pid)
            except RuntimeError as e:
                tail = log.read_text(errors="replace")[-800:]
                rows.append({"name": f"sglang-router:{policy}", "error": f"{e}: {tail}"})

        modes = os.environ.get("KVROUTE_BENCH_PROXY_MODES", "sse,json,json_resp").split(",")
        for mode, size, conc in [
            (m, s, c) for m in modes for s in (2_000, 200_000) for c in (1, 32)
        ]:
            if mode == "json_resp":  # a 2 KB request asking for a ``size``-byte answer
                body = _body(2_000, stream=False, max_tokens=size)
            else:
                body = _body(size, stream=mode == "sse")
            n = (150 if conc == 1 else 600) if quick else (400 if conc == 1 else 2000)
            # Paths take turns for ROUNDS rounds (n/ROUNDS calls each) and report the median
            # round, so load from other processes on this shared machine hits all of them alike.
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
            for _ in range(ROUNDS):
                for name, (url, pid) in paths.items():
                    runs[name].append(asyncio.run(_load(url, body, conc, n // ROUNDS, pid)))
            case = {name: _median_run(rs) for name, rs in runs.items()}
            for name, res in case.items():
                row: dict[str, Any] = {
                    "name": f"{mode}_{size // 1000}KB_c{conc}_{name}",
                    "mode": mode,
                    "body_bytes": size,
                    "concurrency": conc,
                    "path": name,
                    "n": res["n"],
                    "rps": round(res["rps"], 1),
                    "p50_ms": round(res["p50_ms"], 2),
                    "p90_ms": round(res["p90_ms"], 2),
                    "errors": res["errors"],
                }
                if "cpu_ms_per_req" in res:
                    row["cpu_ms_per_req"] = round(res["cpu_ms_per_req"], 3)
                row["rps_vs_direct"] = round(res["rps"] / case["direct"]["rps"], 3)
                sgl = case.get("sglang-router:round_robin")
                if sgl:
                    row["rps_vs_sglang"] = round(res["rps"] / sgl["rps"], 3)
                rows.append(row)
    finally:
        for p in procs:
            _stop(p)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--backend":
        backend_main(int(sys.argv[2]))
    else:
        for r in run(quick="--quick" in sys.argv):
            print(r)
