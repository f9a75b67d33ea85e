"""``kvroute serve --workers N``: N processes on one port (SO_REUSEPORT) under one parent.

Real processes (``python -m router.serve``) in front of a fake replica in the test's loop:
both workers answer on the one port, the YAML file, env vars and flags reach every worker,
a worker killed with SIGKILL leaves the port served (and is started again), and SIGTERM to
the parent drains every worker's calls before it exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.test_router_proxy import CHAT, FakeReplica

pytestmark = pytest.mark.timeout(90)

ADMIN = "workers-admin-key"


class Served:
    def __init__(self, proc: asyncio.subprocess.Process, url: str):
        self.proc, self.url = proc, url


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    f = await FakeReplica("r0").start()
    yield f
    await f.stop()


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Any]:
    started: list[asyncio.subprocess.Process] = []

    async def start(replica_url: str, *flags: str) -> Served:
        conf = tmp_path / "router.yaml"
        conf.write_text("session_ttl_s: 123\nhealth_interval_s: 30\n")
        env = {**os.environ, "KVROUTE_ADMIN_KEY": ADMIN, "KVROUTE_RETRIES": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.serve", "--config", str(conf), "--port", "0",
            "--replica", replica_url, "--policy", "round_robin", "--log-level", "warning",
            *flags, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        started.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"kvroute listening on "), line
        return Served(proc, line.split()[-1].decode())

    yield start
    for p in started:
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)  # the parent stops its workers
            try:
                await asyncio.wait_for(p.wait(), 20)
            except TimeoutError:
                p.kill()
                await p.wait()


async def fresh(url: str, path: str, **kw: Any) -> tuple[int, Any]:
    """One call on its own connection (so the kernel picks a worker for it)."""
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=20)) as s:
        method = "POST" if "json" in kw else "GET"
        async with s.request(method, url + path, **kw) as r:
            return r.status, await r.json()


async def workers_seen(
    url: str, want: int, tries: int = 200, within_s: float = 30.0
) -> dict[int, int]:
    """worker index -> pid, from /health, until ``want`` workers answered: at least ``tries``
    calls, and on for up to ``within_s`` while fewer answered (a worker still starting on a
    loaded machine has not joined the port yet: 200 quick calls all met the other one)."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + within_s
    n = 0
    while len(seen) < want and (n < tries or time.monotonic() < deadline):
        n += 1
        with_status = await fresh(url, "/health")
        if with_status[0] == 200:
            seen[with_status[1]["worker"]] = with_status[1]["pid"]
        if n >= tries:
            await asyncio.sleep(0.05)
    return seen


def gone(pid: int) -> bool:
    """The process exited (a zombie counts: its sockets are closed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def test_two_workers_answer_on_one_port_with_the_same_config(replica, serve):
    s = await serve(replica.url, "--workers", "2", "--breaker-failures", "7")
    seen = await workers_seen(s.url, 2)
    assert sorted(seen) == [0, 1] and len(set(seen.values())) == 2
    configs: dict[int, str] = {}
    for _ in range(200):
        status, doc = await fresh(s.url, "/admin/config", headers={"X-Admin-Key": ADMIN})
        assert status == 200  # the env's admin key works on every worker
        configs[doc["worker"]] = doc["config"]
        if len(configs) == 2:
            break
    assert sorted(configs) == [0, 1]
    for text in configs.values():  # YAML, env and flags, on each worker
        assert "session_ttl_s=123.0" in text and "retries=1" in text
        assert "breaker_failures=7" in text and "workers=2" in text
    for _ in range(6):
        status, doc = await fresh(s.url, "/v1/chat/completions", json={**CHAT, "stream": False})
        assert status == 200 and doc["replica"] == "r0"


async def test_a_killed_worker_does_not_take_the_port_down(replica, serve):
    s = await serve(replica.url, "--workers", "2")
    seen = await workers_seen(s.url, 2)
    os.kill(seen[0], signal.SIGKILL)
    # until its listening socket is closed (on a loaded machine 0.1 s was not enough: a call
    # the kernel still gave the dying socket was refused)
    for _ in range(200):  # 10 s at most
        if gone(seen[0]):
            break
        await asyncio.sleep(0.05)
    for _ in range(20):  # served by the other worker meanwhile
        status, doc = await fresh(s.url, "/health")
        assert status == 200 and doc["pid"] != seen[0]
    # the parent starts worker 0 again, on the same port
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        again = await workers_seen(s.url, 2, tries=20)
        if again.get(0) not in (None, seen[0]):
            break
        await asyncio.sleep(0.2)
    assert again.get(0) not in (None, seen[0]), again
    assert s.proc.returncode is None


async def test_sigterm_drains_every_worker_then_the_parent_exits(replica, serve):
    replica.delay_s = 1.0  # each call in flight for a second
    s = await serve(replica.url, "--workers", "2", "--drain-timeout-s", "10")
    await workers_seen(s.url, 2)
    calls = [
        asyncio.create_task(fresh(s.url, "/v1/chat/completions", json={**CHAT, "stream": False}))
        for _ in range(6)
    ]
    # wait until all six are at the replica: a call still in the backlog of a listener that
    # the drain closes is reset (a fixed 0.4 s sleep lost that race once on a busy box)
    for _ in range(100):
        if len(replica.seen) >= 6:
            break
        await asyncio.sleep(0.02)
    assert len(replica.seen) == 6
    s.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*calls)
    assert [st for st, _ in results] == [200] * 6
    assert await asyncio.wait_for(s.proc.wait(), 15) == 0
    with pytest.raises(aiohttp.ClientConnectionError):
        await fresh(s.url, "/health")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def test_workers_stop_when_the_parent_is_killed(replica, serve):
    s = await serve(replica.url, "--workers", "2")
    seen = await workers_seen(s.url, 2)
    s.proc.kill()  # SIGKILL: the parent cannot pass anything on
    await s.proc.wait()
    for _ in range(150):  # up to 15 s
        if not any(_alive(p) for p in seen.values()):
            break
        await asyncio.sleep(0.1)
    assert not any(_alive(p) for p in seen.values())  # nobody left holding the port


async def test_one_process_freezes_its_startup_heap_and_runs_the_stall_watch(replica):
    """``kvroute serve`` (one process) freezes what start-up left on the heap out of the
    collector's full passes (router.serve.freeze_startup_heap) and, with
    ``loop_stall_log_ms``, runs the stall watch and stops it cleanly on SIGTERM."""
    env = {**os.environ, "KVROUTE_LOOP_STALL_LOG_MS": "20"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.serve", "--port", "0", "--replica", replica.url,
        "--policy", "round_robin", "--log-level", "info",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"kvroute listening on "), line
        url = line.split()[-1].decode()
        status, _ = await fresh(url, "/v1/chat/completions", json={**CHAT, "stream": False})
        assert status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        err = (await asyncio.wait_for(proc.stderr.read(), 20)).decode()
        code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0, err
    frozen = [ln for ln in err.splitlines() if "start-up heap frozen:" in ln]
    assert len(frozen) == 1, err
    assert int(frozen[0].split("frozen:")[1].split()[0]) > 10_000
    assert "Traceback" not in err and "sampling failed" not in err


async def test_two_workers_see_the_same_kv_placements(serve, tmp_path: Path) -> None:
    """Each worker subscribes to every replica's KV events and builds its own index: blocks
    that one replica reports stored are matched there by both workers, so both place a call
    with that prompt on it (kv_cost, two replicas, events for one; the publisher keeps a
    replay buffer as vLLM's does, so a worker that joins after its first batches catches
    up from seq 0 instead of going stale)."""
    import zmq
    import zmq.asyncio

    from loadtest import tinymodel
    from router.kv.tokens import SessionTokenizer
    from router.vllm.hashing import BlockHasher
    from router.vllm.kvevents import encode_block_stored
    from router.vllm.prompt import request_prompt
    from router.vllm.tokenizer import ModelTokenizer
    from tests.integration.test_kv_events import Publisher
    from tests.integration.test_router_proxy import FakeReplica

    r0, r1 = await FakeReplica("r0").start(), await FakeReplica("r1").start()
    zctx = zmq.asyncio.Context()
    pub = Publisher(zctx, "kv@r1", replay=True)
    port = pub.pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        model = tinymodel.ensure()
        text = " ".join(["agents share this long prompt"] * 60)
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        tok = ModelTokenizer.from_dir(model)
        prompt = request_prompt(tok, "/v1/chat/completions", body)
        assert prompt is not None
        keys = (
            SessionTokenizer(tok, BlockHasher(16))
            .prompt(prompt.text, add_special_tokens=prompt.add_special_tokens)
            .keys
        )
        assert len(keys) >= 8
        extra = tmp_path / "kv.yaml"
        extra.write_text(
            f"kv:\n  tokenizer: {model}\n  block_size: 16\n"
            f"  events_connect: {{'{r1.url}': 'tcp://127.0.0.1:{port}'}}\n"
            f"  replay: {{'{r1.url}': '{pub.replay_endpoint}'}}\n"
        )
        s = await serve(r0.url, "--workers", "2", "--replica", r1.url, "--policy", "kv_cost",
                        "--config", str(extra))  # fmt: skip
        seen: dict[int, tuple[str, int]] = {}
        for _ in range(400):  # PUB/SUB joins asynchronously: publish until both have it
            await pub.send(encode_block_stored(keys, None, [], 16))
            status, doc = await fresh(s.url, "/admin/route?explain=1", json=body,
                                      headers={"X-Admin-Key": ADMIN})  # fmt: skip
            assert status == 200, doc
            cand = {c["replica"]: c for c in doc["explain"]["candidates"]}
            matched = cand[r1.url]["terms"]["kv_cost"]["match_blocks"]
            if matched == len(keys):
                seen[doc["worker"]] = (doc["winner"], matched)
            if len(seen) == 2:
                break
            await asyncio.sleep(0.02)
        assert seen == {0: (r1.url, len(keys)), 1: (r1.url, len(keys))}
    finally:
        await pub.close()
        zctx.term()
        await r0.stop()
        await r1.stop()
