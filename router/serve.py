"""``kvroute serve``: run the router in front of vLLM replicas.

Every flag is also settable by env (``KVROUTE_<NAME>``) and YAML (``--config FILE``, same key
names as the flags with ``_``); precedence: flags > env > YAML > defaults. On SIGTERM/SIGINT
the router stops taking new calls (503 + ``Retry-After``, ``/ready`` turns 503), lets in-flight
streams finish for up to ``--drain-timeout-s``, then exits. Uses uvloop when installed.
``--workers N`` runs N processes on one port (``SO_REUSEPORT``); what each keeps to itself
is in docs/router.md ("Workers"). Heavy imports happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

_SKIP = {"scheduling", "api_keys", "kv"}  # YAML/env only (structured), see docs/router.md

# the help text of every flag made from a RouterConfig field (tests/unit/test_kv_autoconf.py
# checks that every flag has one); docs/router.md has the long form
HELP = {
    "host": "listen address (default 127.0.0.1)",
    "port": "listen port (default 8000; 0: any free port, the chosen URL is printed)",
    "replica_dns": "http://NAME:PORT re-resolved every --dns-interval-s, one replica per "
    "address (a Kubernetes headless service; repeat)",
    "dns_interval_s": "seconds between DNS re-resolutions of --replica-dns (default 10)",
    "k8s_service": "discover replicas from this Service's EndpointSlices (in-cluster)",
    "k8s_namespace": "namespace of --k8s-service (default: default)",
    "k8s_port_name": "the EndpointSlice port to use (default: the first)",
    "k8s_interval_s": "longest back-off between failed EndpointSlice list/watch tries (5)",
    "k8s_watch_timeout_s": "server-side timeout of one EndpointSlice watch request (300)",
    "k8s_dns_suffix": "e.g. svc.cluster.local: name StatefulSet pods by hostname, not IP",
    "k8s_api_url": "Kubernetes API server (default: the in-cluster service)",
    "k8s_sa_dir": "service-account directory holding token and ca.crt",
    "policy": "scheduling policy (default kv_cost; ignored when a scheduling: pipeline is "
    "given in --config)",
    "redis_url": "redis://HOST:PORT/DB: a session table shared by several routers",
    "session_ttl_s": "idle seconds after which a session is forgotten (3600)",
    "redis_timeout_s": "seconds per Redis operation before serving from the local view (0.25)",
    "redis_reconcile_interval_s": "seconds between probes of a Redis that went away (1)",
    "health_interval_s": "seconds between health checks (GET /health, /v1/models) (2)",
    "metrics_interval_s": "seconds between scrapes of each replica's /metrics (1)",
    "health_timeout_s": "timeout of one health check or scrape, seconds (2)",
    "health_failures": "consecutive timed-out health checks before a replica is unhealthy (3)",
    "connect_timeout_s": "upstream TCP connect timeout, seconds (5)",
    "read_timeout_s": "longest upstream silence, first byte included, seconds (600)",
    "first_byte_timeout_s": "a call with no response head by then moves to another replica "
    "(30; 0: off)",
    "unstreamed_first_byte_timeout_s": "the same for non-streamed calls (0: off, the default)",
    "stream_idle_timeout_s": "a stream silent this long after its first chunk is ended (60; "
    "0: off)",
    "header_timeout_s": "seconds a client has to send a complete request head (10)",
    "priority": "session-level call priority sent to replicas as X-Vllm-Priority (needs vLLM "
    "--scheduling-policy priority, the engine preset's; docs/router.md#priority)",
    "priority_unit_tokens": "attained service (tokens) that one priority level doubles (4096)",
    "priority_max_level": "highest priority level from attained service (8)",
    "priority_level_s": "aging: seconds a waiting call gains a level (2; bound: levels x this)",
    "admission": "while every replica is full, calls wait in the router in priority order "
    "(docs/router.md#admission)",
    "admission_max_waiting": "vLLM waiting requests that make a replica full (8)",
    "admission_max_kv_usage": "vLLM KV cache usage that makes a replica full (0.98)",
    "admission_timeout_s": "longest wait in the router, then 503 with Retry-After (30)",
    "admission_max_queued": "calls waiting at most, then 429 with Retry-After (1024)",
    "pd_mode": "with prefill/decode replica roles: split each call when priced cheaper (auto), "
    "always or never (docs/router.md#disaggregation)",
    "pd_min_prompt_tokens": "uncached prompts shorter than this run colocated (512)",
    "send_timeout_s": "a client that reads nothing of a streamed answer this long is cut and the "
    "upstream call closed (30; 0: off)",
    "pool_timeout_s": "longest wait for an upstream connection at the connection limits, then a "
    "503 naming the limit; the replica is not blamed (60; 0: no bound)",
    "idle_timeout_s": "seconds an idle client connection is kept (75)",
    "client_body_timeout_s": "seconds a client has to send its body, else 408 (30)",
    "max_body_bytes": "largest request body, decoded (32 MiB), else 413",
    "max_header_bytes": "longest request line or header field (8190)",
    "max_connections": "upstream connection pool size (1024)",
    "max_connections_per_replica": "upstream connections per replica (256)",
    "retries": "other replicas tried before the first response byte (2)",
    "breaker_failures": "consecutive failures that open a replica's circuit breaker (3)",
    "breaker_cooldown_s": "seconds an open breaker waits before its half-open probe (5)",
    "drain_timeout_s": "on SIGTERM, seconds in-flight streams may finish (30)",
    "workers": "router processes on the one port (SO_REUSEPORT; default 1)",
    "upstream_api_key": "bearer key sent to replicas (prefer KVROUTE_UPSTREAM_API_KEY)",
    "admin_key": "enables /admin/* with this key (prefer KVROUTE_ADMIN_KEY)",
    "prefix_chars": "leading prompt characters keyed on for a body without turns (4096)",
    "engine_hints": "true/false: send retention hints to the engine plugin (default false)",
    "log_level": "log level (default info)",
    "decision_log": "append one JSON line per placement to this file",
    "loop_stall_log_ms": "log what filled an event-loop stall longer than this (0: off)",
}
CHOICES = {"log_level": ["debug", "info", "warning", "error", "critical"],
           "engine_hints": ["true", "false"], "priority": ["off", "session"],
           "admission": ["off", "on"], "pd_mode": ["auto", "always", "never"]}  # fmt: skip


def _policies() -> list[str]:
    from router.scheduling.registry import discover, names

    discover()
    return names("policy")


def kv_layer(cfg: Any) -> Any:
    """The KV layer (:class:`router.kv.state.KVState`): from ``cfg.kv`` when it is set (a
    ``kv:`` YAML mapping or ``KVROUTE_KV_*`` env vars); zero-config (``discover``: tokenizer,
    block size and hash algorithm from the replicas, the generic profile calibrated online)
    when it is not, or leaves the wiring unsaid (:meth:`router.kv.config.KVConfig.is_bare`:
    only ``events_port`` and tuning), and the policy reads the layer
    (``kv_cost``, the default); else ``None``. Imported only then, so a plain router never
    loads the tokenizer stack."""
    kv = cfg.kv
    if kv is None or kv.is_bare():
        from router.app import reads_kv
        from router.scheduling.registry import build_pipeline

        if not reads_kv(build_pipeline(cfg.scheduling if cfg.scheduling else cfg.policy)):
            return None
        from router.kv.config import KVConfig

        kv = dataclasses.replace(kv or KVConfig(), discover=True, profile="none")
    from router.kv.state import KVState

    return KVState(kv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.config import RouterConfig

    p.add_argument("--config", metavar="FILE", help="YAML file with any of the settings below")
    p.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        default=None,
        metavar="URL",
        help="a replica base URL (repeat); URL#role=prefill|decode gives it a P/D role",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="accept this client key (enables auth; repeat)",
    )
    p.add_argument(
        "--kv-events-port",
        dest="kv_events_port",
        type=int,
        default=None,
        metavar="PORT",
        help="subscribe to each replica's KV events at tcp://<replica host>:PORT (vLLM "
        "--kv-events-config with endpoint tcp://*:PORT), for static, DNS and Kubernetes "
        "replicas; with no kv: settings the rest of the KV layer comes from the replicas "
        "(KVROUTE_KV_EVENTS_PORT)",
    )
    for f in dataclasses.fields(RouterConfig):
        if f.name in _SKIP or f.name == "replicas":
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        text = HELP.get(f.name)
        if t.startswith("list"):
            p.add_argument(flag, dest=f.name, action="append", default=None, metavar="VALUE",
                           help=text)  # fmt: skip
        else:
            typ: Any = int if t.startswith("int") else float if t.startswith("float") else str
            choices = _policies() if f.name == "policy" else CHOICES.get(f.name)
            if f.name in CHOICES:
                typ = str.lower  # --log-level WARNING as well as warning
            metavar = None if choices else f.name.upper()
            p.add_argument(flag, dest=f.name, type=typ, default=None, metavar=metavar,
                           choices=choices, help=text)  # fmt: skip


def _config_error(msg: str) -> Exception:
    from router.config import ConfigError

    return ConfigError(msg)


def config_from_args(args: argparse.Namespace, env: Any = None) -> Any:
    """The :class:`router.config.RouterConfig` the parsed flags, ``env`` (default: the
    process's) and ``--config`` make; ``--kv-events-port`` wins over ``kv.events_port``."""
    from router.config import RouterConfig, load_config

    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(RouterConfig)}
    cfg = load_config(args.config, env=env, overrides=overrides)
    port = getattr(args, "kv_events_port", None)
    if port is not None:
        from router.kv.config import KVConfig

        try:
            cfg.kv = dataclasses.replace(cfg.kv or KVConfig(), events_port=port)
        except ValueError as e:
            raise _config_error(f"--kv-events-port: {e}") from None
    if cfg.workers > 1 and cfg.kv is not None and cfg.kv.events_bind:
        # one SUB socket binds the address: the second worker's bind would fail, and it would
        # be started again and again
        raise _config_error(
            f"kv.events_bind ({cfg.kv.events_bind}) with workers {cfg.workers}: only one process "
            "can bind it; with --workers let each worker subscribe to the replicas' publishers "
            "(--kv-events-port or kv.events_connect)"
        )
    return cfg


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from router.config import ConfigError

    try:
        cfg = config_from_args(args)
        from router.scheduling.registry import build_pipeline

        build_pipeline(cfg.scheduling if cfg.scheduling else cfg.policy)  # fail before binding
        if cfg.decision_log:  # an unwritable path is a configuration error, not a traceback
            open(cfg.decision_log, "ab").close()
        kv = kv_layer(cfg) if cfg.workers == 1 else None  # workers build their own
    except (ConfigError, ValueError, OSError) as e:
        print(f"kvroute serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if cfg.workers > 1:
        return serve_workers(cfg)
    return serve_one(cfg, kv)


def freeze_startup_heap() -> int:
    """Move every object alive now into the collector's permanent generation
    (``gc.freeze()``); returns how many were frozen.

    Called once the app has started (imports, tokenizer, KV layer, the first health checks):
    those objects live as long as the process, yet every full (generation 2) collection
    walked all of them — ~90 ms on this heap (numpy, scipy, aiohttp, jinja2, tokenizers;
    measured: docs/reliability.md, "Through the HTTP path"), a stall of the event loop every
    time one ran. Frozen, a full collection walks only what the router allocated since.

    No collection first: one here is itself a full pass (~100 ms, a stall as the app is already
    serving: measured at 4dcac2e); the start-up garbage it would have freed stays, once."""
    import gc

    gc.freeze()
    return gc.get_freeze_count()


def serve_one(cfg: Any, kv: Any, *, worker: int = 0, reuse_port: bool = False) -> int:
    """One router process on ``cfg.host:cfg.port`` until SIGTERM/SIGINT, then drain."""
    import asyncio
    import logging
    import signal

    log = logging.getLogger("kvroute")

    async def main() -> int:
        from router.app import PIPELINE, RUNTIME, build_app, drain, start_site

        app = build_app(cfg, kv=kv)
        app[RUNTIME].worker = worker
        runner, url = await start_site(app, cfg.host, cfg.port, reuse_port=reuse_port)
        frozen = freeze_startup_heap()
        log.info("start-up heap frozen: %d objects out of the collector's full passes", frozen)
        log.info(
            "kvroute serving on %s (policy %s, state %s, %d replicas%s)",
            url,
            app[PIPELINE].name,
            "redis" if cfg.redis_url else "memory",
            len(cfg.replicas),
            f", worker {worker} of {cfg.workers}" if cfg.workers > 1 else "",
        )
        print(f"kvroute listening on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("draining (up to %.0f s)", cfg.drain_timeout_s)
        clean = await drain(app, cfg.drain_timeout_s)
        await runner.cleanup()
        log.info("stopped (%s)", "drained" if clean else "drain deadline hit")
        return 0

    try:
        import uvloop

        return int(uvloop.run(main()))
    except ImportError:
        return int(asyncio.run(main()))


def _term_with_parent(parent: int) -> None:
    """A worker gets SIGTERM (drains and exits) when the parent dies, even by SIGKILL: a
    worker outliving it would hold the port with nobody to restart or stop it (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    import ctypes
    import os
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


RESTART_DELAY_S = 0.5  # before a worker that died is started again
MAX_RESTARTS = 10  # within RESTART_WINDOW_S: more means something is wrong; give up
RESTART_WINDOW_S = 60.0


def serve_workers(cfg: Any) -> int:
    """``--workers N``: N forked processes, each its own event loop, app, upstream pool and
    health monitors, listening on one port with ``SO_REUSEPORT`` (the kernel spreads new
    connections over them). This parent serves nothing: it holds the port (a bound socket
    that never listens, so ``--port 0`` picks one port for all and a restarted worker gets
    it back), starts a worker again when one dies, and on SIGTERM/SIGINT passes the signal
    on and waits for every worker to drain. A worker exiting with status 2 (a configuration
    error, e.g. the KV layer failing to build) stops them all."""
    import dataclasses as dc
    import logging
    import os
    import signal
    import socket
    import time

    log = logging.getLogger("kvroute")
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    hold = socket.socket(family, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        hold.bind((cfg.host, cfg.port))
    except OSError as e:
        print(f"kvroute serve: cannot bind {cfg.host}:{cfg.port}: {e}", flush=True)
        return 2
    port = hold.getsockname()[1]
    if not cfg.redis_url:
        log.warning("%d workers without redis_url: each keeps its own session table, so a "
                    "session's affinity holds only within one worker", cfg.workers)  # fmt: skip
    wcfg = dc.replace(cfg, port=port)
    parent = os.getpid()
    children: dict[int, int] = {}  # pid -> worker index
    stopping = False
    result = 0

    def spawn(i: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _term_with_parent(parent)
                hold.close()
                try:
                    kv = kv_layer(wcfg)
                except (ValueError, OSError) as e:
                    log.error("worker %d: %s", i, e)
                    code = 2
                else:
                    code = serve_one(wcfg, kv, worker=i, reuse_port=True)
            except BaseException:
                log.exception("worker %d failed", i)
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = i

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for i in range(cfg.workers):
        spawn(i)
    log.info("%d workers on port %d (pids %s)", cfg.workers, port,
             " ".join(map(str, children)))  # fmt: skip
    restarts: list[float] = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        i = children.pop(pid, -1)
        code = os.waitstatus_to_exitcode(status)
        if stopping or i < 0:
            continue
        if code == 2:
            log.error("worker %d exited with a configuration error; stopping", i)
            result = 2
            on_signal(signal.SIGTERM, None)
            continue
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(restarts) > MAX_RESTARTS:
            log.error("%d worker restarts in %.0f s; stopping", len(restarts), RESTART_WINDOW_S)
            result = 1
            on_signal(signal.SIGTERM, None)
            continue
        log.warning("worker %d (pid %d) exited with %d; starting it again", i, pid, code)
        time.sleep(RESTART_DELAY_S)
        if not stopping:
            spawn(i)
    hold.close()
    log.info("every worker stopped")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m router.serve ...`` = ``kvroute serve ...`` without the other subcommands."""
    p = argparse.ArgumentParser(prog="kvroute serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    import sys

    sys.exit(main())
