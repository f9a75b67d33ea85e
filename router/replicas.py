"""Replicas: discovery (static, DNS, Kubernetes EndpointSlices), health, load, breakers.

Owns: the live replica set and everything the router knows about each replica — health from
``GET /health``, served models from ``GET /v1/models``, queue and KV usage scraped from vLLM's
``GET /metrics`` (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``), the router's own in-flight count and a per-replica circuit
breaker. Policies see only :class:`EndpointView` copies. Background loops are plain
coroutines started by the app's cleanup context; one slow replica never blocks another
(every probe has its own timeout). Must not import scheduling, handlers, torch or vllm.

Circuit breaker: ``closed`` → after ``failures`` consecutive failures → ``open`` (no traffic)
→ after ``cooldown_s`` → ``half_open``: exactly one request (the probe) may go; its success
closes the breaker, its failure re-opens it for another cooldown.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from router.config import ROLES, split_role, strip_role, strip_url_credentials  # noqa: F401
from router.kv.autoconf import CACHE_INFO, cache_config_labels

log = logging.getLogger("kvroute.replicas")

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
BREAKER_CODE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
VLLM_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    # the engine plugin's cadence scheduler (and the twin): prompt tokens still to prefill
    "vllm:num_pending_prefill_tokens": "pending_prefill",
}
# cached prompt tokens by tier (vLLM >= 0.33, label ``source``: device, host, disk, ...), else
# the undivided total (re-exported as source "all")
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
CACHED_TOTAL = "vllm:prompt_tokens_cached_total"
# the engine plugin's host-tier shares (engine_patches.offload, which router/ does not import):
# the largest over label sets (one per engine), not their sum
VLLM_SHARES = {
    "vllm:kv_offload_cpu_cache_occupancy_perc": "host_occupancy",
    "vllm:kv_offload_cpu_retained_perc": "host_retained",
}


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0):
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probe_inflight = False

    def allows(self, now: float | None = None) -> bool:
        """Whether a new request may be sent now (does not change state)."""
        if self.state == CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state == OPEN:
            return now - self.opened_at >= self.cooldown_s
        return not self.probe_inflight

    def on_send(self, now: float | None = None) -> bool:
        """A call is being sent; True when it is the half-open probe (its owner must then
        report the verdict, or :meth:`on_abandon` it)."""
        now = time.monotonic() if now is None else now
        if self.state == OPEN and now - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN:
            self.probe_inflight = True
            return True
        return False

    def on_success(self) -> None:
        self.state, self.failures, self.probe_inflight = CLOSED, 0, False

    def on_abandon(self) -> None:
        """The probe call ended without a verdict (client went away): free the probe slot.
        Only the probe's own call may call this (see :meth:`on_send`)."""
        self.probe_inflight = False

    def on_failure(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.threshold:
            self.state, self.opened_at = OPEN, now
        self.probe_inflight = False


class EndpointView(NamedTuple):
    """What a policy may know about one replica (a copy; changing it changes nothing).

    A named tuple, not a frozen dataclass: one is built per replica per scheduling decision,
    and a tuple is built in a quarter of the time (0.3 µs against 1.3 µs for these 14
    fields). Immutable all the same; a changed copy is ``view._replace(field=...)``."""

    name: str
    url: str
    healthy: bool
    models: frozenset[str]
    inflight: int
    running: float | None
    waiting: float | None
    kv_usage: float | None
    breaker: str
    accepting: bool = True  # breaker closed, or a half-open probe slot is free
    host_occupancy: float | None = None  # share of the host KV tier holding data (plugin)
    host_retained: float | None = None  # share held for paused sessions (plugin's retention)
    pending_prefill: float | None = None  # prompt tokens still to prefill (plugin's cadence)
    pending_prefill_age_s: float | None = None  # seconds since the scrape that read it
    role: str = "both"  # P/D disaggregation: "prefill", "decode" or "both" (router.disagg)

    @property
    def load(self) -> float:
        """Requests on the replica: router in-flight, or the engine's own count when larger."""
        engine = (self.running or 0.0) + (self.waiting or 0.0)
        return max(float(self.inflight), engine)


@dataclass
class Replica:
    url: str
    source: str = "static"
    healthy: bool = True  # optimistic until the first probe says otherwise
    health_strikes: int = 0  # consecutive timed-out health probes
    models: frozenset[str] = frozenset()
    model_cards: list[dict[str, Any]] = field(default_factory=list)
    inflight: int = 0
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    # the engine plugin's host-tier gauges: share of chunks holding data, share held for
    # paused sessions (None: not exported)
    host_occupancy: float | None = None
    host_retained: float | None = None
    pending_prefill: float | None = None  # the plugin's / twin's pending prefill tokens
    scraped_at: float | None = None  # time.monotonic() when the last good scrape was sent
    cached_by_source: dict[str, float] = field(default_factory=dict)  # engine counters by tier
    # the labels of vLLM's vllm:cache_config_info (block size, hash algorithm, KV capacity):
    # read from the first scrape that has them (None: none yet), for the zero-config KV layer
    cache_config: dict[str, str] | None = None
    last_error: str | None = None
    # Calls this router finished on the replica (monotonic), and the value when the last
    # /metrics scrape was sent: the scraped engine count still includes those calls.
    finished: int = 0
    finished_at_scrape: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    # ``Authorization`` from credentials in the configured URL (wins over the upstream key)
    auth: str | None = field(default=None, repr=False)
    role: str = "both"  # from the URL's ``#role=`` fragment (see :func:`split_role`)

    @property
    def name(self) -> str:
        return self.url

    def view(self) -> EndpointView:
        return EndpointView(
            self.name, self.url, self.healthy, self.models, self.inflight,
            self.running_now(), self.waiting, self.kv_usage, self.breaker.state,
            self.breaker.allows(), self.host_occupancy, self.host_retained, self.pending_prefill,
            None if self.scraped_at is None else time.monotonic() - self.scraped_at, self.role,
        )  # fmt: skip

    def running_now(self) -> float | None:
        """The engine's running count at the last scrape, less the calls this router has
        finished there since (clamped at 0). Without this, a session whose previous call just
        ended still sees that call in a stale scrape, and bounded-load affinity moves it."""
        if self.running is None:
            return None
        return max(0.0, self.running - (self.finished - self.finished_at_scrape))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "url": self.url, "source": self.source, "healthy": self.healthy,
            "models": sorted(self.models), "inflight": self.inflight, "running": self.running,
            "waiting": self.waiting, "kv_usage": self.kv_usage, "breaker": self.breaker.state,
            "host_occupancy": self.host_occupancy, "host_retained": self.host_retained,
            "pending_prefill": self.pending_prefill, "last_error": self.last_error,
            "role": self.role,
        }  # fmt: skip


def normalize_url(url: str) -> str:
    """The replica's name: the URL without a trailing ``/``, without credentials and without
    a ``#role=`` fragment."""
    return strip_url_credentials(strip_role(url).rstrip("/"))


def url_auth(url: str) -> str | None:
    """The ``Authorization`` value that credentials in a replica URL stand for
    (``http://user:pass@host`` -> HTTP Basic), or None. They are taken out of the URL, so
    they show nowhere and aiohttp does not refuse them next to an explicit header."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.username is None and parts.password is None:
        return None
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


ReplicaListener = Callable[[frozenset[str], frozenset[str]], None]


class ReplicaSet:
    """The live replicas, keyed by URL; each discovery source replaces only its own list.

    A URL is in the set while at least one source lists it (``Replica.source`` names one of
    them): a URL that two sources list leaves only when neither does. Listeners
    (:meth:`add_listener`) are called with ``(added, removed)`` names after each change of
    membership, from whichever source: names that entered or left the set, not a source's
    own view (a URL another source still lists neither leaves nor re-enters)."""

    def __init__(self, breaker_failures: int = 3, breaker_cooldown_s: float = 5.0):
        self._by_name: dict[str, Replica] = {}
        self._lists: dict[str, set[str]] = {}  # source -> the URLs it lists
        self._breaker = (breaker_failures, breaker_cooldown_s)
        self._listeners: list[ReplicaListener] = []
        self.version = 0

    def add_listener(self, fn: ReplicaListener) -> None:
        """Call ``fn(added, removed)`` after every membership change (errors are logged)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: ReplicaListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    def __iter__(self) -> Any:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Replica | None:
        return self._by_name.get(name)

    def sources(self, name: str) -> set[str]:
        """The sources that list ``name`` now (empty when none does)."""
        return {src for src, urls in self._lists.items() if name in urls}

    def set_source(self, source: str, urls: Iterable[str]) -> tuple[set[str], set[str]]:
        """Make ``source``'s list exactly ``urls``; returns the (added, removed) names of that
        list. Membership (and the listeners) changes only for names no other source lists."""
        urls = list(urls)
        want = {normalize_url(u) for u in urls}
        auth = {normalize_url(u): url_auth(strip_role(u)) for u in urls}
        roles = {}
        for u in urls:
            try:
                roles[normalize_url(u)] = split_role(u)[1]
            except ValueError as e:  # validated at start-up; discovery input may be odd
                log.warning("%s; serving it as role both", e)
                roles[normalize_url(u)] = "both"
        have = self._lists.get(source, set())
        added, removed = want - have, have - want
        if want:
            self._lists[source] = want
        else:
            self._lists.pop(source, None)
        entered = frozenset(n for n in added if n not in self._by_name)
        left: set[str] = set()
        for n in removed:
            others = self.sources(n)
            r = self._by_name.get(n)
            if not others:
                left.add(n)
                self._by_name.pop(n, None)
            elif r is not None and r.source == source:
                r.source = min(others)  # still listed: another source owns it now
        for n in entered:
            self._by_name[n] = Replica(n, source, breaker=CircuitBreaker(*self._breaker))
        for n in want:
            r = self._by_name.get(n)
            if r is not None and auth.get(n) is not None:
                r.auth = auth[n]
            if r is not None:
                r.role = roles[n]
        if added or removed:
            self.version += 1
            log.info("replicas from %s: +%s -%s", source, sorted(added), sorted(removed))
        if entered or left:
            for fn in list(self._listeners):
                try:
                    fn(entered, frozenset(left))
                except Exception:  # a listener must not break discovery
                    log.exception("replica listener %r failed", fn)
        return added, removed

    def views(self) -> tuple[EndpointView, ...]:
        return tuple(r.view() for r in self._by_name.values())


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the gauges the router needs over all label sets (one engine may list several),
    the cached-prompt-token counters as ``cached:<source>`` keys (``cached:all`` only when
    the engine does not split them by tier), and the engine plugin's host-tier shares (their
    largest).

    Parsed with prometheus_client's exposition parser (labels, escapes and timestamps are its
    business); a malformed exposition yields what was parsed before the error.
    """
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isfinite(sample.value):
                    continue
                share = VLLM_SHARES.get(sample.name)
                if share is not None:
                    out[share] = max(out.get(share, 0.0), sample.value)
                    continue
                key = VLLM_GAUGES.get(sample.name)
                if sample.name == CACHED_BY_SOURCE:
                    key = "cached:" + sample.labels.get("source", "unknown")
                elif sample.name == CACHED_TOTAL:
                    key = "cached:all"
                if key is not None:
                    out[key] = out.get(key, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as e:
        log.warning("malformed /metrics exposition (%s); using what parsed", e)
    if len([k for k in out if k.startswith("cached:")]) > 1:
        out.pop("cached:all", None)
    return out


def _by_source(parsed: Mapping[str, float]) -> dict[str, float]:
    return {k[7:]: v for k, v in parsed.items() if k.startswith("cached:")}


def cached_by_source(text: str) -> dict[str, float]:
    """The engine's cached prompt tokens by tier (``device``, ``host``, ``disk``, …) from a
    ``/metrics`` exposition; ``{"all": n}`` when it does not split them."""
    return _by_source(parse_vllm_metrics(text))


# --- Kubernetes EndpointSlice discovery -------------------------------------------------


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


# --- background monitors ---------------------------------------------------------------


def next_scrape_at(due: float, now: float, interval: float) -> float:
    """When the next ``/metrics`` round starts, given when the last one was due and the time
    now (after it): one interval after it was due, or — when the round ran past that — one
    interval from now (missed rounds are skipped, never run back to back)."""
    nxt = due + interval
    return nxt if nxt >= now else now + interval


class ReplicaMonitor:
    """Health checks, model lists, metrics scrapes and discovery loops for one ReplicaSet."""

    def __init__(self, replicas: ReplicaSet, session: aiohttp.ClientSession, cfg: Any):
        self.replicas = replicas
        self.session = session
        self.cfg = cfg
        self.health_rounds = 0
        self._probe_timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
        self._headers = (
            {"Authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}
        )
        # EndpointSlice list+watch state: slices by name, the resourceVersion to resume from
        # (None: list first), and whether the watch is live (else DNS stands in)
        self._k8s_slices: dict[str, Mapping[str, Any]] = {}
        self._k8s_rv: str | None = None
        self._k8s_listed = False
        self.k8s_synced = False
        self.k8s_stats = {"lists": 0, "watches": 0, "events": 0, "relists_gone": 0}
        self._k8s_added: set[str] = set()

    def headers_for(self, r: Replica) -> dict[str, str]:
        """Probe headers: the replica's own URL credentials, else the upstream key."""
        return {"Authorization": r.auth} if r.auth else self._headers

    async def check_one(self, r: Replica) -> None:
        hdrs = self.headers_for(r)
        try:
            async with self.session.get(
                r.url + "/health", timeout=self._probe_timeout, headers=hdrs
            ) as resp:
                ok = resp.status == 200
                await resp.read()
            if ok:
                async with self.session.get(
                    r.url + "/v1/models", timeout=self._probe_timeout, headers=hdrs
                ) as resp:
                    if resp.status == 200:
                        doc = orjson.loads(await resp.read())
                        data = doc.get("data") if isinstance(doc, dict) else None
                        if not isinstance(data, list):
                            raise ValueError("/v1/models answered without a data list")
                        r.model_cards = [m for m in data if isinstance(m, dict) and "id" in m]
                        r.models = frozenset(str(m["id"]) for m in r.model_cards)
            if ok != r.healthy:
                log.warning("replica %s is now %s", r.name, "healthy" if ok else "unhealthy")
            r.healthy, r.last_error = ok, None if ok else "health check failed"
            r.health_strikes = 0
        except TimeoutError as e:
            # slow is not down: only health_failures timeouts in a row take it out
            r.health_strikes += 1
            limit = max(1, int(self.cfg.health_failures))
            if r.health_strikes < limit:
                log.info("replica %s: health check timed out (%d of %d)", r.name,
                         r.health_strikes, limit)  # fmt: skip
                return
            if r.healthy:
                log.warning("replica %s failed its health check %d times: %r", r.name,
                            r.health_strikes, e)  # fmt: skip
            r.healthy, r.last_error = False, f"health: {type(e).__name__}"
        except (aiohttp.ClientError, ValueError, OSError) as e:
            r.health_strikes = 0
            if r.healthy:
                log.warning("replica %s failed its health check: %r", r.name, e)
            r.healthy, r.last_error = False, f"health: {type(e).__name__}"

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_one(r) for r in self.replicas))
        self.health_rounds += 1

    async def scrape_one(self, r: Replica) -> None:
        mark, sent = r.finished, time.monotonic()
        try:
            async with self.session.get(
                r.url + "/metrics", timeout=self._probe_timeout, headers=self.headers_for(r)
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError, UnicodeDecodeError):
            return
        m = parse_vllm_metrics(text)
        r.running, r.waiting, r.kv_usage = m.get("running"), m.get("waiting"), m.get("kv_usage")
        r.host_occupancy, r.host_retained = m.get("host_occupancy"), m.get("host_retained")
        r.pending_prefill = m.get("pending_prefill")
        r.cached_by_source = _by_source(m)
        r.finished_at_scrape, r.scraped_at = mark, sent
        if r.cache_config is None and CACHE_INFO in text:
            r.cache_config = cache_config_labels(text)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # one odd replica answer must not stop health checks for good
                log.exception("health round failed; retrying next interval")

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(r) for r in self.replicas if r.healthy))

    async def metrics_loop(self) -> None:
        """Scrape every healthy replica's ``/metrics`` at a fixed rate: a round starts every
        ``metrics_interval_s`` whatever the last one took (a 50 ms interval is 50 ms between
        reads, not 50 ms plus the round), and a round that overran starts the next one an
        interval after it ended (:func:`next_scrape_at`)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = next_scrape_at(due, loop.time(), self.cfg.metrics_interval_s)
            await asyncio.sleep(max(0.0, due - loop.time()))
            try:
                await self.scrape_all()
            except Exception:
                log.exception("metrics round failed; retrying next interval")

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
            await asyncio.gather(*(self.check_one(r) for n in added if (r := self.replicas.get(n))))

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
        await asyncio.gather(*(self.check_one(r) for n in added if (r := self.replicas.get(n))))

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
        t = [
            asyncio.create_task(self.health_loop(), name="kvroute-health"),
            asyncio.create_task(self.metrics_loop(), name="kvroute-metrics-scrape"),
        ]
        if self.cfg.replica_dns:
            t.append(asyncio.create_task(self.dns_loop(), name="kvroute-dns"))
        if self.cfg.k8s_service:
            t.append(asyncio.create_task(self.k8s_loop(), name="kvroute-k8s"))
        return t


K8S_BACKOFF_MIN_S = 0.1


class WatchFailed(Exception):
    """The EndpointSlice watch could not be (re)started or read."""


class ResourceGone(Exception):
    """410 Gone: the resourceVersion to resume from is no longer kept; list again."""


def _slice_name(sl: Mapping[str, Any], fallback: int) -> str:
    name = (sl.get("metadata") or {}).get("name")
    return str(name) if name else f"#{fallback}"


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
