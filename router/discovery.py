"""Replica discovery: which replicas exist — DNS names (one replica per address) and Kubernetes
EndpointSlices (list, then watch from the list's resourceVersion).

Owns: :class:`ReplicaDiscovery` (the DNS and EndpointSlice loops, writing the ``dns:<i>`` and
``k8s`` sources of a :class:`router.replicas.ReplicaSet`), :func:`endpoints_from_slices` (ready
endpoint URLs from an EndpointSlice list) and :func:`diff`. With ``k8s_service`` set, the
DNS names are its fallback, resolved only while the watch is not live. Must not import
scheduling, handlers, torch or vllm.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from router.replicas import Replica, ReplicaSet
from router.urls import strip_url_credentials

log = logging.getLogger("kvroute.discovery")
K8S_BACKOFF_MIN_S = 0.1


class WatchFailed(Exception):
    """The EndpointSlice watch could not be (re)started or read."""


class ResourceGone(Exception):
    """410 Gone: the resourceVersion to resume from is no longer kept; list again."""


def _slice_name(sl: Mapping[str, Any], fallback: int) -> str:
    name = (sl.get("metadata") or {}).get("name")
    return str(name) if name else f"#{fallback}"


def endpoints_from_slices(
    slices: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    port_name: str | None = None,
    scheme: str = "http",
    host_suffix: str | None = None,
) -> set[str]:
    """Ready endpoint URLs from an EndpointSlice list (``discovery.k8s.io/v1``).

    Takes the ``items`` list (or the list response itself). An endpoint counts when its
    ``conditions.ready`` is not false and it is not terminating. The port is the one named
    ``port_name``, else the slice's first port. With ``host_suffix``
    (``<service>.<namespace>.svc.<domain>``) an endpoint that has a ``hostname`` (a
    StatefulSet pod under its governing Service) is named ``<hostname>.<host_suffix>``: a
    stable name across pod restarts, which static per-pod settings (KV event endpoints) can
    key on. Others are named by address.
    """
    items = slices.get("items", []) if isinstance(slices, Mapping) else slices
    urls: set[str] = set()
    for sl in items:
        ports = sl.get("ports") or []
        port = None
        for p in ports:
            if port_name is None or p.get("name") == port_name:
                port = p.get("port")
                break
        if port is None:
            continue
        ipv6 = sl.get("addressType") == "IPv6"
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            if host_suffix and ep.get("hostname"):
                urls.add(f"{scheme}://{ep['hostname']}.{host_suffix}:{port}")
                continue
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if ipv6 else addr
                urls.add(f"{scheme}://{host}:{port}")
    return urls


def diff(old: set[str], new: set[str]) -> tuple[set[str], set[str]]:
    """(added, removed) between two discovery results."""
    return new - old, old - new


class ReplicaDiscovery:
    """The DNS and EndpointSlice discovery loops of one :class:`ReplicaSet`: each source
    replaces only its own list there; replicas a round adds are health-checked at once
    (``check``, the monitor's :meth:`router.monitor.ReplicaMonitor.check_one`)."""

    def __init__(
        self,
        replicas: ReplicaSet,
        session: aiohttp.ClientSession,
        cfg: Any,
        check: Callable[[Replica], Awaitable[None]],
    ):
        self.replicas = replicas
        self.session = session
        self.cfg = cfg
        self.check = check
        self._probe_timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
        # EndpointSlice list+watch state: slices by name, the resourceVersion to resume from
        # (None: list first), and whether the watch is live (else DNS stands in)
        self._k8s_slices: dict[str, Mapping[str, Any]] = {}
        self._k8s_rv: str | None = None
        self._k8s_listed = False
        self.k8s_synced = False
        self.k8s_stats = {"lists": 0, "watches": 0, "events": 0, "relists_gone": 0}
        self._k8s_added: set[str] = set()

    async def resolve_dns(self) -> None:
        """Re-resolve every ``replica_dns`` name; one replica per address (headless service).
        With ``k8s_service`` set these names are its fallback: resolved only while the
        EndpointSlice watch is not synced (API unreachable or forbidden)."""
        loop = asyncio.get_running_loop()
        if self.cfg.k8s_service and self.k8s_synced:
            self._clear_dns()
            return
        for i, base in enumerate(self.cfg.replica_dns):
            u = urlsplit(base)
            port = u.port or (443 if u.scheme == "https" else 80)
            try:
                infos = await loop.getaddrinfo(u.hostname, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("cannot resolve %s: %s (keeping the last answer)",
                            strip_url_credentials(base), e)  # fmt: skip
                continue
            urls = set()
            userinfo = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
            for fam, *_rest, addr in infos:
                host = f"[{addr[0]}]" if fam == socket.AF_INET6 else addr[0]
                urls.add(urlunsplit((u.scheme, f"{userinfo}{host}:{port}", u.path, "", u.fragment)))
            added, _ = self.replicas.set_source(f"dns:{i}", urls)
            await asyncio.gather(*(self.check(r) for n in added if (r := self.replicas.get(n))))

    async def dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.dns_interval_s)
            await self.resolve_dns()

    def _clear_dns(self) -> None:
        for i in range(len(self.cfg.replica_dns)):
            self.replicas.set_source(f"dns:{i}", [])

    def _k8s_target(self) -> tuple[str, Any, Path | None] | None:
        """(EndpointSlice list URL, ssl arg, token file) from config or the in-cluster env."""
        api = self.cfg.k8s_api_url
        sa = Path(self.cfg.k8s_sa_dir)
        if not api:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            if not host:
                return None
            api = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
        ssl_arg: Any = None
        if api.startswith("https://"):
            ca = sa / "ca.crt"
            ssl_arg = ssl.create_default_context(cafile=str(ca)) if ca.exists() else True
        url = (
            f"{api.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/"
            f"{self.cfg.k8s_namespace}/endpointslices"
        )
        token = sa / "token"
        return url, ssl_arg, token if token.exists() else None

    def _k8s_headers(self, token_file: Path | None) -> dict[str, str]:
        if token_file is None:  # re-read each time: the kubelet rotates it
            return {}
        return {"Authorization": f"Bearer {token_file.read_text().strip()}"}

    def _k8s_apply(self) -> None:
        """Replace the ``k8s`` source with the ready endpoints of the slices known now."""
        cfg = self.cfg
        suffix = getattr(cfg, "k8s_dns_suffix", None)
        host_suffix = f"{cfg.k8s_service}.{cfg.k8s_namespace}.{suffix}" if suffix else None
        urls = endpoints_from_slices(
            list(self._k8s_slices.values()), cfg.k8s_port_name, host_suffix=host_suffix
        )
        added, _ = self.replicas.set_source("k8s", urls)
        self._k8s_added = added

    async def _check_added(self) -> None:
        added, self._k8s_added = self._k8s_added, set()
        await asyncio.gather(*(self.check(r) for n in added if (r := self.replicas.get(n))))

    def _k8s_sync(self, synced: bool) -> None:
        if synced and not self.k8s_synced:
            self._clear_dns()  # the watch is live again: DNS stands down
        elif not synced and self.k8s_synced:
            log.warning("EndpointSlice watch lost; %s", "falling back to DNS" if
                        self.cfg.replica_dns else "keeping the last answer")  # fmt: skip
        self.k8s_synced = synced

    async def poll_k8s(self) -> bool:
        """One EndpointSlice LIST: replace the ``k8s`` source and remember the list's
        resourceVersion for the watch; False (and keep the last answer) when the API cannot
        be read."""
        target = self._k8s_target()
        if target is None:
            log.error("--k8s-service needs a cluster (KUBERNETES_SERVICE_HOST is not set)")
            self._k8s_sync(False)
            return False
        url, ssl_arg, token_file = target
        params = {"labelSelector": f"kubernetes.io/service-name={self.cfg.k8s_service}"}
        try:
            async with self.session.get(
                url, params=params, ssl=ssl_arg, timeout=self._probe_timeout,
                headers=self._k8s_headers(token_file),
            ) as resp:  # fmt: skip
                resp.raise_for_status()
                data = orjson.loads(await resp.read())
            if not isinstance(data, dict):
                raise ValueError("EndpointSlice list is not an object")
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            log.warning("EndpointSlice list failed: %r (keeping the last answer)", e)
            self._k8s_sync(False)
            return False
        self.k8s_stats["lists"] += 1
        items = data.get("items") or []
        self._k8s_slices = {_slice_name(sl, i): sl for i, sl in enumerate(items)}
        self._k8s_rv = (data.get("metadata") or {}).get("resourceVersion")
        self._k8s_listed = True
        self._k8s_apply()
        self._k8s_sync(True)
        await self._check_added()
        return True

    async def watch_k8s(self) -> int:
        """One WATCH request from the last resourceVersion (with bookmarks), applying each
        ADDED / MODIFIED / DELETED slice as it arrives; returns the events seen when the
        server ends the stream. Raises :class:`ResourceGone` on 410 (the caller re-lists) and
        :class:`WatchFailed` / client errors on anything else."""
        target = self._k8s_target()
        if target is None:
            raise WatchFailed("no cluster (KUBERNETES_SERVICE_HOST is not set)")
        url, ssl_arg, token_file = target
        timeout_s = int(getattr(self.cfg, "k8s_watch_timeout_s", 300))
        params = {
            "labelSelector": f"kubernetes.io/service-name={self.cfg.k8s_service}",
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        if self._k8s_rv:
            params["resourceVersion"] = self._k8s_rv
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.cfg.health_timeout_s, sock_read=timeout_s + 30
        )
        seen = 0
        self.k8s_stats["watches"] += 1
        async with self.session.get(
            url, params=params, ssl=ssl_arg, timeout=timeout,
            headers=self._k8s_headers(token_file),
        ) as resp:  # fmt: skip
            if resp.status == 410:
                raise ResourceGone(f"watch from resourceVersion {self._k8s_rv}: 410 Gone")
            if resp.status != 200:
                raise WatchFailed(f"watch answered HTTP {resp.status}")
            self._k8s_sync(True)
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._k8s_event(orjson.loads(line))
                        seen += 1
                await self._check_added()
            if buf.strip():
                self._k8s_event(orjson.loads(buf))
                seen += 1
                await self._check_added()
        return seen

    def _k8s_event(self, ev: Any) -> None:
        """Apply one watch event (``{"type", "object"}``)."""
        if not isinstance(ev, dict) or not isinstance(ev.get("object"), dict):
            raise WatchFailed(f"not a watch event: {str(ev)[:200]}")
        kind, obj = ev.get("type"), ev["object"]
        self.k8s_stats["events"] += 1
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise ResourceGone(str(obj.get("message", "410 Gone")))
            raise WatchFailed(f"watch error {code}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            self._k8s_rv = rv or self._k8s_rv
            return
        name = _slice_name(obj, len(self._k8s_slices))
        if kind in ("ADDED", "MODIFIED"):
            self._k8s_slices[name] = obj
        elif kind == "DELETED":
            self._k8s_slices.pop(name, None)
        else:
            raise WatchFailed(f"unknown watch event type {kind!r}")
        self._k8s_rv = rv or self._k8s_rv
        self._k8s_apply()

    async def k8s_loop(self) -> None:
        """List, then watch from the list's resourceVersion, forever: a stream the server
        ends is resumed from the last resourceVersion (bookmarks keep it fresh); 410 Gone
        (that version is compacted away) re-lists at once; any other failure re-lists after
        an exponential back-off (0.1 s doubling up to ``k8s_interval_s``), while DNS (when
        ``replica_dns`` is set) stands in."""
        delay = K8S_BACKOFF_MIN_S
        while True:
            try:
                if not self._k8s_listed and not await self.poll_k8s():
                    raise WatchFailed("list failed")
                t0 = time.monotonic()
                seen = await self.watch_k8s()
                if seen == 0 and time.monotonic() - t0 < 1.0:
                    raise WatchFailed("watch ended at once")  # do not spin on a bad server
                delay = K8S_BACKOFF_MIN_S
            except ResourceGone as e:
                log.info("EndpointSlice watch: %s; re-listing", e)
                self.k8s_stats["relists_gone"] += 1
                self._k8s_listed = False
            except (WatchFailed, TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
                log.warning("EndpointSlice watch failed: %r; retrying in %.1f s", e, delay)
                self._k8s_sync(False)
                self._k8s_listed = False
                await self.resolve_dns()
                await asyncio.sleep(delay)
                delay = min(delay * 2, max(self.cfg.k8s_interval_s, K8S_BACKOFF_MIN_S))

    def tasks(self) -> list[asyncio.Task[None]]:
        """The DNS loop (with ``replica_dns``) and the EndpointSlice loop (``k8s_service``)."""
        t = []
        if self.cfg.replica_dns:
            t.append(asyncio.create_task(self.dns_loop(), name="kvroute-dns"))
        if self.cfg.k8s_service:
            t.append(asyncio.create_task(self.k8s_loop(), name="kvroute-k8s"))
        return t
