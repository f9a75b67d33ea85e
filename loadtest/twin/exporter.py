"""The twin's ``/metrics``: vLLM's metric names and buckets, wall-clock like a real replica.

Owns: :class:`TwinMetrics` — request, token, prefix-cache and KV-usage counters and gauges,
the engine plugin's host-tier gauges and a pending-prefill gauge (twin only), the TTFT / ITL /
end-to-end histograms (vLLM 0.32's buckets), rendered in Prometheus text
format from the twin's engine state. Must not import aiohttp, torch or vllm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# the engine plugin's gauge names (that module imports vLLM only inside functions)
from engine_patches.offload import HOST_OCCUPANCY, HOST_RETAINED, PENDING_PREFILL

if TYPE_CHECKING:
    from loadtest.twin.replica import TwinReplica

# Pending prefill work (PENDING_PREFILL): exported, as by the engine plugin, only where the
# plugin's cadence scheduler and a host tier are both on (engine_patches/offload.py ships it
# with the host tier's stats). Real vLLM (0.32/0.33) has no such series, so a router in front of
# plain twins reads no more than it would in front of plain vLLM.

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


# ---- /metrics -------------------------------------------------------------------------------


class TwinMetrics:
    """vLLM's metric names (``vllm/v1/metrics/loggers.py``), rendered from engine state on
    scrape; labels ``model_name`` and ``engine`` like vLLM's."""

    def __init__(self, twin: TwinReplica):
        self.twin = twin
        self.ttft: list[float] = []
        self._ttft_seen = 0
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.",
                                ["model_name", "engine"], registry=self.registry,
                                buckets=TTFT_BUCKETS)  # fmt: skip

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        twin = self.twin
        eng = twin.engine
        labels = f'model_name="{twin.cfg.served_model_name}",engine="0"'
        h = self.h_ttft.labels(twin.cfg.served_model_name, "0")
        for v in self.ttft[self._ttft_seen :]:
            h.observe(v)
        self._ttft_seen = len(self.ttft)
        if self._ttft_seen > 10_000:
            self.ttft.clear()
            self._ttft_seen = 0
        p = twin.profile
        lines = []

        def gauge(name: str, doc: str, value: float, extra: str = "") -> None:
            lines.append(
                f"# HELP {name} {doc}\n# TYPE {name} gauge\n"
                f"{name}{{{labels}{extra}}} {float(value)}"
            )

        def counter(name: str, doc: str, value: float) -> None:
            lines.append(
                f"# HELP {name}_total {doc}\n# TYPE {name}_total counter\n"
                f"{name}_total{{{labels}}} {float(value)}"
            )

        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            eng.num_running(),
        )
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            eng.num_waiting(),
        )
        gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage()
        )
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            eng.prefix_queries,
        )
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            eng.cached_by_source["device"],  # vLLM's engine prefix cache only
        )
        counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens_total
        )
        counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            eng.prefix_hits,
        )
        name = "vllm:prompt_tokens_cached_by_source_total"
        lines.append(f"# HELP {name} Cached prompt tokens by the tier that served them.\n"
                     f"# TYPE {name} counter")  # fmt: skip
        for source, n in eng.cached_by_source.items():
            lines.append(f'{name}{{{labels},source="{source}"}} {float(n)}')
        counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            eng.generation_tokens_total,
        )
        counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            eng.preemptions,
        )
        pending = eng.pending_prefill_gauge()
        if pending is not None:
            gauge(
                PENDING_PREFILL,
                "Prompt tokens still to compute: running prefill chunks and waiting requests "
                "net of their cached prefix (engine plugin; vLLM has no such field).",
                pending,
            )
        cpu = eng.cpu
        if cpu is not None and cpu.capacity > 0:
            # the engine plugin's host-tier signals (engine_patches/offload.py)
            gauge(HOST_OCCUPANCY, "Share of host-tier KV chunks holding data.",
                  len(cpu) / cpu.capacity)  # fmt: skip
            retained = cpu.retained_share(eng.now)
            if retained is not None:
                gauge(HOST_RETAINED, "Share of host-tier KV chunks held for paused sessions.",
                      retained)  # fmt: skip
        # vLLM 0.32 labels this gauge with every CacheConfig attribute (str() of each) and
        # `engine`, no model_name (vllm/v1/metrics/loggers.py log_metrics_info); the zero-config
        # KV layer reads block_size, prefix_caching_hash_algo, num_gpu_blocks and
        # kv_cache_size_tokens from it. A subset of vLLM's labels, with its spelling.
        info = (
            f'block_size="{p.block_size}",cache_dtype="auto",enable_prefix_caching="True",'
            f'engine="0",hash_block_size="{p.block_size}",'
            f'kv_cache_size_tokens="{p.gpu_kv_blocks * p.block_size}",'
            f'num_cpu_blocks="{p.cpu_kv_blocks}",num_gpu_blocks="{p.gpu_kv_blocks}",'
            f'prefix_caching_hash_algo="{twin.cfg.hash_algo}"'
        )
        lines.append(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{info}}} 1.0"
        )
        gauge("kvroute:twin_speedup", "Model seconds per wall second of this twin.", twin.speedup)
        gauge(
            "kvroute:twin_lag_seconds",
            "Wall seconds the engine trailed its model-time "
            "schedule at its last step (> 0.01: too slow for its speedup).",
            twin.lagged_s,
        )
        # the twin's own split of the cached tokens: the pool apart from the disk tier (vLLM
        # labels both "disk"), for the bench's hit ratio by source
        name = "kvroute:twin_prompt_tokens_cached_by_tier_total"
        lines.append(f"# HELP {name} Cached prompt tokens by the tier that served them "
                     f"(twin; the cluster pool apart from the disk tier).\n"
                     f"# TYPE {name} counter")  # fmt: skip
        for source, n in eng.cached_by_tier.items():
            lines.append(f'{name}{{{labels},source="{source}"}} {float(n)}')
        text = "\n".join(lines) + "\n"
        return text.encode() + generate_latest(self.registry)
