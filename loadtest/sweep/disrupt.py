"""Disruptions during a bench point: a rolling restart, a scale-out, a lost replica.

Owns: :data:`DISRUPTIONS`, :class:`Disruptor` (a thread that, on the replay's clock, tells the
twins to restart, come up or go down through their ``/twin/disrupt`` route and records when)
and the figures a disrupted point adds to its summary (:func:`disruption_figures`): the TTFT of
each affected session's first call after a disruption (median / p99), and the hit ratio by
source over the point (device / host / disk / pool / recomputed, from the twins' own
``kvroute:twin_prompt_tokens_cached_by_tier_total``). Must not import the router.

What each disruption does (times in modelled seconds from the replay's start):

* ``rolling-restart``: from ``at_s`` on, each replica in turn is drained (new calls and its
  ``/health`` get 503; calls in flight finish), restarted with an empty cache (HBM, host and
  disk tiers; a cluster pool stays) and back after ``downtime_s``; the next one starts when
  it is back, as a rolling upgrade with ``maxUnavailable: 1`` does. A session is affected by a
  restart when its last call before it went to that replica.
* ``scale-out``: ``extra`` more replicas are started with the cluster but down (503) before
  the replay starts, and all come up at ``at_s``, empty. Routers are handed every URL from
  the start (none here registers workers at run time): the new replicas are what a router's
  health checks find up. Every session is affected (its first call after ``at_s``).
* ``replica-loss``: the last replica goes down at ``at_s`` (calls in flight cut, new calls
  503) and stays down. Affected: the sessions whose last call went to it.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

DISRUPTIONS = ("rolling-restart", "scale-out", "replica-loss")
TIER = "kvroute:twin_prompt_tokens_cached_by_tier_total"
QUERIES = "vllm:prefix_cache_queries_total"
SOURCES = ("device", "host", "disk", "pool")


@dataclass
class Disruptor:
    """Runs one disruption against twins ``urls`` (names ``names``) on the replay's clock."""

    kind: str
    urls: Sequence[str]
    names: Sequence[str]
    speedup: float
    at_s: float  # modelled seconds after the replay's start
    downtime_s: float = 30.0  # a restart's modelled seconds down (rolling-restart)
    extra: int = 0  # scale-out: the last ``extra`` replicas start down and come up at at_s
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DISRUPTIONS:
            raise ValueError(f"unknown disruption {self.kind!r}; known: {', '.join(DISRUPTIONS)}")
        if self.kind == "scale-out" and not 0 < self.extra < len(self.urls):
            raise ValueError("scale-out needs 0 < extra < replicas")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _post(self, c: httpx.Client, url: str, action: str, **kw: Any) -> None:
        r = c.post(url + "/twin/disrupt", json={"action": action, **kw})
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {action}: {r.status_code} {r.text[:200]}")

    def prepare(self) -> None:
        """Before the replay: scale-out's extra replicas go down (not yet started)."""
        if self.kind == "scale-out":
            with httpx.Client(timeout=10) as c:
                for url in self.urls[-self.extra :]:
                    self._post(c, url, "down")

    def on_start(self, t0: float) -> None:
        """The replay's clock started at monotonic ``t0``: schedule the disruption."""
        self._t0 = t0
        self._thread = threading.Thread(target=self._main, name="disruptor", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds on the replay's clock (``calls.jsonl``'s ``t_start``)."""
        return time.monotonic() - self._t0

    def _main(self) -> None:
        try:
            if self._stop.wait(max(0.0, self.at_s / self.speedup - self.now())):
                return
            with httpx.Client(timeout=10) as c:
                if self.kind == "rolling-restart":
                    for url, name in zip(self.urls, self.names, strict=True):
                        if self._stop.is_set():
                            return
                        ev = {"kind": "restart", "url": url, "replica": name, "t_s": self.now()}
                        before = c.get(url + "/twin/disrupt").json()["restarts"]
                        self._post(c, url, "restart", downtime_s=self.downtime_s)
                        while not self._stop.is_set():
                            st = c.get(url + "/twin/disrupt").json()
                            if st["state"] == "up" and st["restarts"] > before:
                                break
                            time.sleep(0.02)
                        ev["t_up_s"] = self.now()
                        self.events.append(ev)
                elif self.kind == "scale-out":
                    t = self.now()
                    for url, name in zip(self.urls[-self.extra :], self.names[-self.extra :],
                                         strict=True):  # fmt: skip
                        self._post(c, url, "up")
                        self.events.append({"kind": "up", "url": url, "replica": name, "t_s": t})
                else:
                    url, name = self.urls[-1], self.names[-1]
                    self.events.append({"kind": "down", "url": url, "replica": name,
                                        "t_s": self.now()})  # fmt: skip
                    self._post(c, url, "down")
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            self.error = repr(e)[:300]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _served_by(rec: dict[str, Any], ev: dict[str, Any]) -> bool:
    r = rec.get("replica")
    return r is not None and (r == ev["replica"] or r.rstrip("/") == ev["url"].rstrip("/"))


def after_disruption_ttfts(
    calls: list[dict[str, Any]], events: list[dict[str, Any]]
) -> list[float]:
    """Run-clock TTFTs of each affected session's first call that started after each event
    (a failed call counts as its own time to fail: it got no token). A session is affected by
    a restart or a loss when its last call before the event went to that replica (all
    sessions when no call names its replica), by a scale-out always."""
    out: list[float] = []
    known = any(c.get("replica") for c in calls)
    for ev in events:
        t = ev["t_s"]
        last: dict[tuple[Any, Any], dict[str, Any]] = {}
        first: dict[tuple[Any, Any], dict[str, Any]] = {}
        for c in calls:  # calls.jsonl is in t_start order
            key = (c.get("session"), c.get("play"))
            if c["t_start"] < t:
                last[key] = c
            elif key not in first:
                first[key] = c
        for key, c in first.items():
            if ev["kind"] in ("restart", "down") and known:
                prev = last.get(key)
                if prev is None or not _served_by(prev, ev):
                    continue
            if c.get("ok") and c.get("ttft_s") is not None:
                out.append(float(c["ttft_s"]))
            else:
                out.append(float(c["t_end"]) - float(c["t_start"]))
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def hit_sources(metrics_texts: Sequence[str]) -> dict[str, float] | None:
    """Shares of the looked-up prompt tokens served by each source, and ``recomputed``, over
    the twins' ``/metrics`` (None when no twin exports its tiers)."""
    tot = dict.fromkeys(SOURCES, 0.0)
    queries = 0.0
    seen = False
    for text in metrics_texts:
        for m in re.finditer(rf'^{TIER}{{[^}}]*source="(\w+)"}} (\S+)$', text, re.M):
            if m[1] in tot:
                tot[m[1]] += float(m[2])
                seen = True
        q = re.search(rf"^{QUERIES}{{[^}}]*}} (\S+)$", text, re.M)
        if q:
            queries += float(q[1])
    if not seen or queries <= 0:
        return None
    out = {k: v / queries for k, v in tot.items()}
    out["recomputed"] = max(0.0, 1.0 - sum(out.values()))
    return out


def preemptions(metrics_texts: Sequence[str]) -> float | None:
    """The engines' preemptions over the point, summed over the twins' ``/metrics``
    (``vllm:num_preemptions_total``; None when no twin exports it): under ``--priority`` the
    engine preempts the lowest-priority running request, so this says whether that lever was
    used at all."""
    found = [
        float(m[1])
        for text in metrics_texts
        for m in re.finditer(r"^vllm:num_preemptions_total(?:{[^}]*})? (\S+)$", text, re.M)
    ]
    return sum(found) if found else None


def scrape(urls: Sequence[str]) -> list[str]:
    texts = []
    with httpx.Client(timeout=10) as c:
        for u in urls:
            try:
                texts.append(c.get(u + "/metrics").text)
            except httpx.HTTPError:
                continue
    return texts


def disruption_figures(
    calls: list[dict[str, Any]], d: Disruptor | None, metrics_texts: Sequence[str], speedup: float
) -> dict[str, Any]:
    """What a point adds to its summary: the disruption's events and the TTFT (modelled
    seconds) of the affected sessions' first calls after them; the hit ratio by source; the
    engines' preemptions."""
    out: dict[str, Any] = {
        "hit_by_source": hit_sources(metrics_texts),
        "preemptions": preemptions(metrics_texts),
    }
    if d is None:
        return out
    ttfts = [x * speedup for x in after_disruption_ttfts(calls, d.events)]
    events = []
    for e in d.events:
        ev = {**e, "t_s": e["t_s"] * speedup}
        if "t_up_s" in e:
            ev["t_up_s"] = e["t_up_s"] * speedup
        events.append(ev)
    out["disruption"] = {
        "kind": d.kind,
        "at_s": d.at_s,
        "downtime_s": d.downtime_s if d.kind == "rolling-restart" else None,
        "events": events,
        "error": d.error,
        "first_calls_after": len(ttfts),
        "ttft_after_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_after_p99_s": _pct(ttfts, 0.99),
    }
    return out
