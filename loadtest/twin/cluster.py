"""N twin replicas in one process, on consecutive loopback ports: the embedded cluster.

Owns: starting and stopping a set of :class:`loadtest.twin.replica.TwinReplica` web apps that
share one tokenizer, one ZMQ context, one KV-event endpoint (each replica publishes on
its own topic ``kv@<name>``) and, when the profile has ``pool_kv_blocks``, one cluster KV pool
(:class:`loadtest.twin.engine.ClusterPool`: a block any twin wrote is found by all). This is
what ``kvroute cluster`` and ``make demo`` run, and the small programmatic API other parts
of ``loadtest`` build on::

    async with start_cluster(4, "cpu-tiny", speedup=1.0, kv_events=endpoint) as c:
        c.urls      # ["http://127.0.0.1:P", ...]
        c.topics    # ["kv@twin-0", ...]

Must not import torch or vllm.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from costmodel.profiles import ReplicaProfile, load_profile
from loadtest.twin.engine import ClusterPool, EnginePlugin
from loadtest.twin.publisher import publisher_binds
from loadtest.twin.replica import TwinConfig, TwinReplica
from loadtest.twin.server import runner_port, serve
from loadtest.twin.tokenize import ModelTokenizer
from loadtest.twin.truth import timing


@dataclass
class Cluster:
    replicas: list[TwinReplica] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    pool: ClusterPool | None = None  # the cluster KV pool every replica shares, if any

    @property
    def topics(self) -> list[str]:
        return [r.topic for r in self.replicas]

    @property
    def event_endpoints(self) -> list[str | None]:
        """Where each replica publishes: the shared endpoint it connects to, or the address
        it bound (``tcp://127.0.0.1:*`` gives every replica its own port)."""
        return [r.publisher.endpoint if r.publisher else None for r in self.replicas]

    @property
    def replay_endpoints(self) -> list[str | None]:
        """Each replica's KV-event replay endpoint (``kv_events_replay=True``), else None."""
        return [r.publisher.replay_endpoint if r.publisher else None for r in self.replicas]

    @property
    def names(self) -> list[str]:
        return [r.cfg.name for r in self.replicas]

    def by_url(self, url: str) -> TwinReplica:
        return self.replicas[self.urls.index(url)]


@contextlib.asynccontextmanager
async def start_cluster(
    n: int,
    profile: str | ReplicaProfile = "cpu-tiny",
    *,
    speedup: float = 1.0,
    base_port: int = 0,
    host: str = "127.0.0.1",
    kv_events: str | None = None,
    kv_events_topic: str | None = None,
    model_dir: str | Path | None = None,
    served_model_name: str = "tiny",
    name_prefix: str = "twin",
    max_model_len: int | None = None,
    int_hashes: bool = True,
    kv_events_replay: bool = False,
    kv_events_bind: bool | None = None,
    subscribe_wait_s: float = 1.0,
    enable_auto_tool_choice: bool = True,
    zmq_ctx: Any = None,
    plugin: EnginePlugin | None = None,
    truth: str | None = None,
    tool_call_rate: float = 0.5,
    tool_call_rate_after_result: float = 0.2,
    seed: int = 0,
    roles: Sequence[str] | None = None,
) -> AsyncIterator[Cluster]:
    """Start ``n`` twins (ports ``base_port + i``, or free ports when ``base_port`` is 0).

    ``kv_events``: the ZMQ endpoint every replica publishes to. With ``tcp://HOST:PORT`` the
    replicas connect (a subscriber binds it, as with vLLM); with ``tcp://127.0.0.1:*`` each
    replica binds its own free port (see :attr:`Cluster.event_endpoints`), for subscribers
    that connect to one publisher per worker. ``int_hashes=False`` publishes 32-byte
    digests, as vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.
    ``kv_events_replay=True`` gives every replica vLLM's replay service on its own loopback
    port (see :attr:`Cluster.replay_endpoints`). ``kv_events_bind=True`` binds ``kv_events``
    even with a named host (``tcp://127.0.0.2:P``, one replica: a vLLM on its own host binding
    ``tcp://*:P``). Connecting publishers wait up to
    ``subscribe_wait_s`` (in all) for their subscriber's subscription before the cluster is
    handed out, so a subscriber bound beforehand sees every batch from ``seq`` 0.
    ``truth``: the engines' timing (:mod:`loadtest.twin.truth`, e.g. ``"nominal"``); None
    times steps by ``costmodel.steptime`` (the router's own model).
    ``enable_auto_tool_choice``, ``tool_call_rate``, ``tool_call_rate_after_result`` and
    ``seed``: how replies use tools and end (:class:`loadtest.twin.replica.TwinConfig`; the
    same seed on every replica, so a request gets the same reply wherever it lands).
    ``roles``: each replica's P/D role (``prefill`` / ``decode`` / ``both``; default both).
    """
    if n < 1:
        raise ValueError("a cluster needs at least one replica")
    if roles is not None and len(roles) != n:
        raise ValueError("roles: one per replica")
    binds = publisher_binds(kv_events or "") if kv_events_bind is None else kv_events_bind
    if kv_events and n > 1 and binds and not kv_events.endswith(":*"):
        raise ValueError(
            "n replicas cannot all bind one endpoint: let a subscriber bind and give its "
            "address (the replicas connect), or bind each replica to its own port with "
            "tcp://127.0.0.1:*"
        )
    prof = load_profile(profile) if isinstance(profile, str) else profile
    if truth is not None:
        timing(prof, truth)  # an unknown name fails here, not in the first step
    if model_dir is None:
        from loadtest import tinymodel

        model_dir = tinymodel.ensure()
    tok = ModelTokenizer(model_dir, prof.block_size)
    own_ctx = None
    if kv_events and zmq_ctx is None:
        import zmq

        own_ctx = zmq_ctx = zmq.Context()
    cluster = Cluster(host=host)
    # one cluster pool for all the twins (the profile's pool_kv_blocks; 0: none)
    cluster.pool = ClusterPool(prof.pool_kv_blocks) if prof.pool_kv_blocks else None
    try:
        for i in range(n):
            cfg = TwinConfig(
                profile=prof,
                model_dir=Path(model_dir),
                name=f"{name_prefix}-{i}",
                served_model_name=served_model_name,
                speedup=speedup,
                kv_events_endpoint=kv_events,
                kv_events_topic=kv_events_topic,
                max_model_len=max_model_len,
                int_hashes=int_hashes,
                kv_events_replay=f"tcp://{host}:*" if kv_events_replay else None,
                kv_events_bind=kv_events_bind,
                enable_auto_tool_choice=enable_auto_tool_choice,
                plugin=plugin or EnginePlugin(),
                truth=truth,
                tool_call_rate=tool_call_rate,
                tool_call_rate_after_result=tool_call_rate_after_result,
                seed=seed,
                role=roles[i] if roles is not None else "both",
                host=host,
            )
            twin = TwinReplica(cfg, tokenizer=tok, zmq_ctx=zmq_ctx, cluster_pool=cluster.pool)
            # owned by the cluster before serve() can fail (a busy --base-port), so the
            # finally below closes its publisher and Context.term() cannot hang on it
            cluster.replicas.append(twin)
            runner = await serve(twin, host, base_port + i if base_port else 0)
            cfg.port = runner_port(runner)
            cluster.runners.append(runner)
            cluster.urls.append(f"http://{host}:{runner_port(runner)}")
        # connecting publishers: give each subscriber's subscription a moment to arrive, so
        # the first events are not dropped (one deadline for the whole cluster)
        deadline = time.monotonic() + subscribe_wait_s
        for twin in cluster.replicas:
            pub = twin.publisher
            if pub is not None and not kv_events_bind and not publisher_binds(pub.endpoint):
                pub.wait_subscribed(max(0.0, deadline - time.monotonic()))
        yield cluster
    finally:
        for runner in cluster.runners:
            await runner.cleanup()
        for twin in cluster.replicas:
            await twin.stop()
        if own_ctx is not None:
            own_ctx.term()
