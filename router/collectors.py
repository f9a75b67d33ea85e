"""Scrape-time collectors of the router's registry: live state read when Prometheus scrapes.

Owns: the replica set's health, engine load and cached tokens by tier; the Redis store's
write-back backlog; KV event stream health; the KV layer's calibration, prompt-analysis
outcomes, mode and cluster pool; and :class:`WithoutCreated` (a registry's families without
``*_created`` samples). Each reads plain objects or zero-argument callables (duck-typed):
this module imports neither the KV layer, the stores nor aiohttp. Registered by
:class:`router.metrics.RouterMetrics`'s ``watch_*`` hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)


class WithoutCreated:
    """The registry's families without ``*_created`` samples (per registry, not global)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for fam in self._registry.collect():
            fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield fam


class ReplicaCollector:
    def __init__(self, replicas: Iterable[Any], runtime: Any):
        self.replicas = replicas
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        lab = ["replica"]
        healthy = GaugeMetricFamily(
            "kvroute_replica_healthy", "Last health check passed", labels=lab
        )
        running = GaugeMetricFamily(
            "kvroute_replica_requests_running", "vLLM running requests (last scrape)", labels=lab
        )
        waiting = GaugeMetricFamily(
            "kvroute_replica_requests_waiting", "vLLM waiting requests (last scrape)", labels=lab
        )
        kv = GaugeMetricFamily(
            "kvroute_replica_kv_cache_usage_perc", "vLLM KV usage, 0-1 (last scrape)", labels=lab
        )
        cached = CounterMetricFamily(
            "kvroute_replica_prompt_tokens_cached",
            "Cached prompt tokens by tier (source) as the replica reports them; source=all when "
            "it does not split them by tier",
            labels=["replica", "source"],
        )
        for r in self.replicas:
            healthy.add_metric([r.name], 1.0 if r.healthy else 0.0)
            if r.running is not None:
                running.add_metric([r.name], r.running)
            if r.waiting is not None:
                waiting.add_metric([r.name], r.waiting)
            if r.kv_usage is not None:
                kv.add_metric([r.name], r.kv_usage)
            for source, v in sorted(getattr(r, "cached_by_source", {}).items()):
                cached.add_metric([r.name, source], v)
        yield from (healthy, running, waiting, kv, cached)
        if self.runtime is not None:
            g = GaugeMetricFamily(
                "kvroute_router_inflight_requests", "Calls this router pod is handling now"
            )
            g.add_metric([], float(self.runtime.inflight))
            yield g


class StoreCollector:
    def __init__(self, store: Any):
        self.store = store

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvroute_redis_pending_writes",
            "Sessions touched while Redis was away, waiting to be written back",
        )
        g.add_metric([], float(self.store.pending_writes))
        c = CounterMetricFamily(
            "kvroute_redis_reconciles", "Write-backs after Redis came back", labels=[]
        )
        c.add_metric([], float(self.store.reconciles))
        yield g
        yield c


class CalibrationCollector:
    """``kvroute_kv_calibration{replica, term}``: the cost model's fitted prefill scale, TTFT
    offset (s), decode scale and hit realization (the share of matched prefixes the engine
    delivered) per replica (1, 0, 1, 1 until enough calls were seen), and the samples behind
    each fit. A scale pinned at a bound (0.2 or 5) means the model and the
    replica disagree by more than any calibration should absorb: look at the replica. For a
    replica that reads the cluster pool (or has pool samples): ``pool_scale`` (observed /
    modelled pool load time; bounds 0.2 and 10) and the calibrated link it gives,
    ``pool_latency_s`` and ``pool_bw`` (bytes/s per GPU), with ``pool`` samples."""

    def __init__(self, kv: Any):
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvroute_kv_calibration",
            "Fitted observed/modelled time per replica: prefill_scale, ttft_offset_s, "
            "decode_scale; hit_realization: share of matched prefixes the engine delivered; "
            "pool_scale, pool_latency_s, pool_bw: the calibrated cluster-pool link "
            "(the cost model's calibration)",
            labels=["replica", "term"],
        )
        n = GaugeMetricFamily(
            "kvroute_kv_calibration_samples",
            "Observations in each replica's calibration window (ttft, itl, hit, pool)",
            labels=["replica", "kind"],
        )
        members = set(self.kv.index.pool_members())
        for name in sorted(self.kv.calibrators):
            c = self.kv.calibration(name)
            g.add_metric([name, "prefill_scale"], c.prefill_scale)
            g.add_metric([name, "ttft_offset_s"], c.ttft_offset_s)
            g.add_metric([name, "decode_scale"], c.decode_scale)
            g.add_metric([name, "hit_realization"], c.hit_realization)
            n.add_metric([name, "ttft"], float(c.ttft_samples))
            n.add_metric([name, "itl"], float(c.itl_samples))
            n.add_metric([name, "hit"], float(c.hit_samples))
            link = self.kv.pool_link(name) if name in members or c.pool_samples else None
            if link is not None:
                g.add_metric([name, "pool_scale"], link["scale"])
                g.add_metric([name, "pool_latency_s"], link["latency_s"])
                g.add_metric([name, "pool_bw"], link["bw"])
                n.add_metric([name, "pool"], float(link["samples"]))
        yield g
        yield n


class KVAnalysisCollector:
    """``kvroute_kv_analyses_total{outcome}``: calls that waited for their own analysis
    (``waited``), were placed without waiting (``not_waited``: queued behind other calls'
    cold work), waited in vain (``late``), were not analysed (``dropped``: the queue was full),
    and waited for a burst leader's placement (``burst_wait``). Many ``not_waited`` calls
    mean cold prompts arrive faster than one process tokenizes them."""

    def __init__(self, kv: Any):
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "kvroute_kv_analyses", "Calls by how their prompt analysis went", labels=["outcome"]
        )
        for outcome, n in sorted(self.kv.analysis_stats().items()):
            c.add_metric([outcome], float(n))
        yield c


class KVModeCollector:
    """``kvroute_kv_layer_mode{mode}``: ``full`` (tokens, block keys and KV events),
    ``approximate`` (kv_cost runs on part of what it needs: /ready says which), ``affinity``
    (no KV layer: kv_cost routes as session affinity), ``off`` (the policy reads no KV
    state). Exactly one is 1."""

    def __init__(self, status: Callable[[], Any]):
        self.status = status

    def collect(self) -> Iterator[Metric]:
        from router.kv.autoconf import MODES

        g = GaugeMetricFamily(
            "kvroute_kv_layer_mode", "How fully the KV layer runs (1: this mode)", labels=["mode"]
        )
        mode = self.status().mode
        for m in MODES:
            g.add_metric([m], 1.0 if m == mode else 0.0)
        yield g


class KVPoolCollector:
    """``kvroute_kv_pool_blocks``: blocks in the cluster pool (KV events with ``locality``
    REMOTE), reachable from every member; ``kvroute_kv_pool_members``: replicas that read it;
    ``kvroute_kv_pool_removed_total``: pool blocks evicted. All 0 without a pool."""

    def __init__(self, kv: Any):
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        ix = self.kv.index
        b = GaugeMetricFamily("kvroute_kv_pool_blocks", "Blocks in the cluster KV pool")
        b.add_metric([], float(ix.pool_blocks()))
        m = GaugeMetricFamily("kvroute_kv_pool_members", "Replicas that read the cluster KV pool")
        m.add_metric([], float(len(ix.pool_members())))
        r = CounterMetricFamily("kvroute_kv_pool_removed", "Blocks evicted from the cluster pool")
        r.add_metric([], float(ix.pool_removed))
        yield b
        yield m
        yield r


class KVEventCollector:
    def __init__(self, subscriber: Callable[[], Any]):
        self.subscriber = subscriber

    def collect(self) -> Iterator[Metric]:
        sub = self.subscriber()
        lab = ["replica"]
        fams = {
            "batches": CounterMetricFamily(
                "kvroute_kv_event_batches", "KV event batches applied to the index", labels=lab
            ),
            "gaps": CounterMetricFamily(
                "kvroute_kv_event_gaps", "Sequence gaps seen (missed batches)", labels=lab
            ),
            "replayed": CounterMetricFamily(
                "kvroute_kv_event_replayed", "Batches refilled from the replay socket", labels=lab
            ),
            "restarts": CounterMetricFamily(
                "kvroute_kv_event_restarts", "Publisher restarts (seq back to 0)", labels=lab
            ),
        }
        lag = GaugeMetricFamily(
            "kvroute_kv_event_lag_seconds",
            "Publish-to-apply delay of the newest applied batch",
            labels=lab,
        )
        errors = CounterMetricFamily(
            "kvroute_kv_event_decode_errors", "Undecodable KV event messages", labels=[]
        )
        if sub is not None:
            stats = sub.stats
            per: dict[str, dict[str, float]] = {}
            lags: dict[str, float] = {}
            for (replica, _rank), st in list(stats.streams.items()):
                d = per.setdefault(replica, dict.fromkeys(fams, 0.0))
                for k in fams:
                    d[k] += getattr(st, k, 0)
                v = getattr(st, "last_lag_s", None)
                if v is not None:
                    lags[replica] = max(lags.get(replica, 0.0), v)
            for replica, d in sorted(per.items()):
                for k, fam in fams.items():
                    fam.add_metric([replica], d[k])
            for replica, v in sorted(lags.items()):
                lag.add_metric([replica], v)
            errors.add_metric([], float(stats.decode_errors))
        yield from fams.values()
        yield lag
        yield errors
