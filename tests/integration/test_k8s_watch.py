"""EndpointSlice discovery (router.discovery) against a fake API server that speaks the watch
protocol: a real aiohttp server on 127.0.0.1 answering LIST with a resourceVersion and WATCH
with chunked JSON lines (ADDED / MODIFIED / DELETED / BOOKMARK / ERROR 410), and able to drop
the stream. Pinned: events change the replica set as they arrive; a dropped stream resumes
from the last resourceVersion (a bookmark's included) without a new LIST; 410 Gone, as an
event or as the watch's HTTP status, re-lists; a failing API backs off while DNS stands in,
and DNS stands down once the watch is live again."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config import RouterConfig
from router.discovery import ReplicaDiscovery
from router.monitor import ReplicaMonitor, cancel_all
from router.replicas import ReplicaSet

pytestmark = pytest.mark.timeout(30)
PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


class FakeAPI:
    """EndpointSlices of one Service, a resourceVersion counter, and live watch streams."""

    def __init__(self) -> None:
        self.rv = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[float, str, dict[str, str]]] = []  # (t, list|watch, query)
        self.list_status = 200
        self.watch_status = 200
        self._streams: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.history: list[tuple[int, dict[str, Any]]] = []  # (rv, event) a watch replays

    def slice(self, name: str, *eps: tuple[str, bool], hostname: bool = False) -> dict[str, Any]:
        self.rv += 1
        return {
            "metadata": {"name": name, "resourceVersion": str(self.rv),
                         "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 9, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [ip], "conditions": {"ready": ready},
                 **({"hostname": f"pod-{ip.rsplit('.', 1)[1]}"} if hostname else {})}
                for ip, ready in eps
            ],
        }  # fmt: skip

    def emit(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self.slices[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        ev = {"type": kind, "object": obj}
        self.history.append((int(obj["metadata"]["resourceVersion"]), ev))
        for q in self._streams:
            q.put_nowait(ev)

    def bookmark(self, rv: int) -> None:
        self.rv = rv
        for q in self._streams:
            q.put_nowait({"type": "BOOKMARK", "object": {
                "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(rv)}}})  # fmt: skip

    def gone(self) -> None:
        """The watch's resourceVersion was compacted away: ERROR 410, then the stream ends."""
        self.history.clear()
        for q in self._streams:
            q.put_nowait({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "too old resource version: 101 (150)", "reason": "Expired",
                "code": 410}})  # fmt: skip
        self.drop()

    def drop(self) -> None:
        """End every open watch stream (a server timeout or a proxy cutting it)."""
        for q in self._streams:
            q.put_nowait(None)
        self._streams.clear()

    @property
    def watching(self) -> int:
        return len(self._streams)

    def of(self, kind: str) -> list[dict[str, str]]:
        return [q for _t, k, q in self.requests if k == kind]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        assert q["labelSelector"] == "kubernetes.io/service-name=vllm"
        if q.get("watch") not in ("1", "true"):
            self.requests.append((time.monotonic(), "list", q))
            if self.list_status != 200:
                return web.Response(status=self.list_status)
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": list(self.slices.values()),
            })  # fmt: skip
        self.requests.append((time.monotonic(), "watch", q))
        assert q["allowWatchBookmarks"] == "true" and int(q["timeoutSeconds"]) > 0
        if self.watch_status != 200:
            return web.json_response({"kind": "Status", "code": self.watch_status},
                                     status=self.watch_status)  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(q.get("resourceVersion") or self.rv)
        for rv, ev in self.history:  # what happened after the version the client knows
            if rv > since:
                queue.put_nowait(ev)
        self._streams.append(queue)
        try:
            while (item := await queue.get()) is not None:
                await resp.write(orjson.dumps(item) + b"\n")
            await resp.write_eof()
        except ConnectionResetError:  # the router closed this watch (after a 410, a drop)
            pass
        return resp


async def until(pred: Callable[[], bool], what: str, within_s: float = 15.0) -> None:
    """Wait (bounded) for state the watch changes in the background."""
    deadline = time.monotonic() + within_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeAPI, str]]:
    fake = FakeAPI()
    app = web.Application()
    app.router.add_get(PATH, fake.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        fake.drop()
        await runner.cleanup()


@pytest.fixture
async def monitor(api, tmp_path) -> AsyncIterator[Callable[..., Any]]:
    _fake, url = api
    started: list[tuple[aiohttp.ClientSession, list[asyncio.Task[None]]]] = []

    async def start(**kw: Any) -> tuple[ReplicaDiscovery, ReplicaSet]:
        cfg = RouterConfig(
            k8s_service="vllm", k8s_namespace="llm", k8s_port_name="http", k8s_api_url=url,
            k8s_sa_dir=str(tmp_path), health_timeout_s=0.5, k8s_interval_s=0.4, **kw,
        )  # fmt: skip
        http = aiohttp.ClientSession()
        rs = ReplicaSet()
        mon = ReplicaMonitor(rs, http, cfg).discovery  # health-checks what it adds
        await mon.resolve_dns()
        await mon.poll_k8s()  # as the app does before taking traffic
        task = asyncio.create_task(mon.k8s_loop())
        started.append((http, [task]))
        return mon, rs

    yield start
    for http, tasks in started:
        await cancel_all(tasks)
        await http.close()


def names(rs: ReplicaSet) -> set[str]:
    return {r.name for r in rs}


async def test_watch_applies_events_and_resumes_from_the_last_resource_version(api, monitor):
    fake, _ = api
    fake.emit("ADDED", fake.slice("vllm-a", ("127.0.0.2", True)))
    mon, rs = await monitor()
    assert names(rs) == {"http://127.0.0.2:9"}
    await until(lambda: fake.watching == 1, "the watch")
    assert fake.of("watch")[0]["resourceVersion"] == str(fake.rv)  # from the LIST's version

    fake.emit("ADDED", fake.slice("vllm-b", ("127.0.0.3", True), ("127.0.0.4", False)))
    await until(lambda: names(rs) == {"http://127.0.0.2:9", "http://127.0.0.3:9"}, "ADDED")
    fake.emit("MODIFIED", fake.slice("vllm-a", ("127.0.0.2", False)))  # not ready any more
    await until(lambda: names(rs) == {"http://127.0.0.3:9"}, "MODIFIED")
    fake.emit("DELETED", fake.slice("vllm-b"))
    await until(lambda: names(rs) == set(), "DELETED")
    fake.emit("ADDED", fake.slice("vllm-c", ("127.0.0.5", True)))
    await until(lambda: names(rs) == {"http://127.0.0.5:9"}, "ADDED again")
    fake.bookmark(500)
    await until(lambda: mon._k8s_rv == "500", "the bookmark")

    fake.drop()  # the stream ends: watch again from the bookmark, no new LIST
    await until(lambda: len(fake.of("watch")) == 2 and fake.watching == 1, "the re-watch")
    assert fake.of("watch")[1]["resourceVersion"] == "500"
    assert len(fake.of("list")) == 1
    assert names(rs) == {"http://127.0.0.5:9"}  # a reconnect keeps what is known
    assert mon.k8s_synced


async def test_410_gone_relists_as_an_event_and_as_a_status(api, monitor):
    fake, _ = api
    fake.emit("ADDED", fake.slice("vllm-a", ("127.0.0.2", True)))
    mon, rs = await monitor()
    await until(lambda: fake.watching == 1, "the watch")
    # while the router was not looking, slices changed and history was compacted
    fake.slices.clear()
    fake.slices["vllm-b"] = fake.slice("vllm-b", ("127.0.0.3", True))
    fake.gone()
    await until(lambda: len(fake.of("list")) == 2, "a re-list after ERROR 410")
    await until(lambda: names(rs) == {"http://127.0.0.3:9"}, "the re-listed state")
    await until(lambda: fake.watching == 1, "the watch after the re-list")
    assert fake.of("watch")[-1]["resourceVersion"] == str(fake.rv)
    assert mon.k8s_stats["relists_gone"] == 1

    fake.watch_status = 410  # the next watch request itself answers 410
    fake.drop()
    # the dropped stream may first count as a failed watch (ended at once: a list after the
    # back-off); the next watch request meets the 410 and re-lists as "gone"
    await until(lambda: mon.k8s_stats["relists_gone"] >= 2, "a re-list after HTTP 410")
    await until(lambda: len(fake.of("list")) >= 3, "the re-list after HTTP 410")
    fake.watch_status = 200
    fake.emit("ADDED", fake.slice("vllm-c", ("127.0.0.4", True)))  # lands in the next LIST
    await until(
        lambda: names(rs) == {"http://127.0.0.3:9", "http://127.0.0.4:9"}, "state after 410"
    )


async def test_failing_api_backs_off_while_dns_stands_in(api, monitor, unused_tcp_port):
    fake, _ = api
    fake.emit("ADDED", fake.slice("vllm-a", ("127.0.0.2", True)))
    fake.list_status = 403  # RBAC not granted yet
    mon, rs = await monitor(replica_dns=[f"http://localhost:{unused_tcp_port}"])
    assert not mon.k8s_synced
    dns = f"http://127.0.0.1:{unused_tcp_port}"
    assert dns in names(rs) and all(r.source.startswith("dns") for r in rs)
    await until(lambda: len(fake.of("list")) >= 5, "retries", within_s=10)
    t = [t for t, k, _q in fake.requests if k == "list"]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert gaps[-1] >= 0.3 and gaps[-1] > gaps[0]  # 0.1 s doubling, capped at 0.4 s
    assert fake.watching == 0

    fake.list_status = 200  # granted: the watch is live and DNS stands down
    await until(lambda: mon.k8s_synced and fake.watching == 1, "the watch")
    assert names(rs) == {"http://127.0.0.2:9"}
    await mon.resolve_dns()  # the DNS loop's next round changes nothing while synced
    assert names(rs) == {"http://127.0.0.2:9"}


async def test_hostname_naming_for_statefulset_pods(api, monitor):
    fake, _ = api
    fake.emit("ADDED", fake.slice("vllm-a", ("127.0.0.2", True), hostname=True))
    _mon, rs = await monitor(k8s_dns_suffix="svc.cluster.local")
    assert names(rs) == {"http://pod-2.vllm.llm.svc.cluster.local:9"}
