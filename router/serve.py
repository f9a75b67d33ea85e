"""``kvroute serve``: run the router in front of vLLM replicas.

Every flag is also settable by env (``KVROUTE_<NAME>``) and YAML (``--config FILE``, same key
names as the flags with ``_``); precedence: flags > env > YAML > defaults. On SIGTERM/SIGINT
the router stops taking new calls (503 + ``Retry-After``, ``/ready`` turns 503), lets in-flight
streams finish for up to ``--drain-timeout-s``, then exits. Uses uvloop when installed.
Heavy imports happen inside :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

_SKIP = {"scheduling", "api_keys", "kv"}  # YAML/env only (structured), see docs/router.md


def kv_layer(cfg: Any, env: Mapping[str, str]) -> Any:
    """The KV-aware layer (:class:`router.scheduling.kv_state.KVState`) when configured by a
    ``kv:`` YAML mapping or ``KVROUTE_KV_*`` env vars (env wins key by key), else ``None``.
    Imported only when configured, so a plain router never loads the tokenizer stack."""
    has_env = any(k.startswith("KVROUTE_KV_") for k in env)
    if not cfg.kv and not has_env:
        return None
    from router.scheduling.kv_state import KVConfig, KVState

    base = dict(cfg.kv or {})
    from_env = KVConfig.from_env(env) if has_env else None
    if from_env is not None:
        for name in KVConfig.__dataclass_fields__:
            if "KVROUTE_KV_" + name.upper() in env:
                base[name] = getattr(from_env, name)
    return KVState(KVConfig.from_mapping(base))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.config import RouterConfig

    p.add_argument("--config", help="YAML file with any of the settings below")
    p.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        default=None,
        metavar="URL",
        help="a replica base URL (repeat)",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="accept this client key (enables auth; repeat)",
    )
    for f in dataclasses.fields(RouterConfig):
        if f.name in _SKIP or f.name == "replicas":
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        if t.startswith("list"):
            p.add_argument(flag, dest=f.name, action="append", default=None, metavar="VALUE")
        else:
            typ: Any = int if t.startswith("int") else float if t.startswith("float") else str
            p.add_argument(flag, dest=f.name, type=typ, default=None, metavar=f.name.upper())


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os
    import signal
    import sys

    from router.config import ConfigError, RouterConfig, load_config

    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(RouterConfig)}
    try:
        cfg = load_config(args.config, overrides=overrides)
        from router.scheduling.registry import build_pipeline

        build_pipeline(cfg.scheduling if cfg.scheduling else cfg.policy)  # fail before binding
        kv = kv_layer(cfg, os.environ)
    except (ConfigError, ValueError, OSError) as e:
        print(f"kvroute serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("kvroute")

    async def main() -> int:
        from router.app import METRICS, PIPELINE, build_app, drain, start_site

        app = build_app(cfg, **(kv.app_kwargs() if kv is not None else {}))
        if kv is not None:  # ZMQ subscribers etc., paired start-up/clean-up
            app.cleanup_ctx.append(kv.lifespan)
            app[METRICS].watch_kv_events(lambda: kv.subscriber)
        runner, url = await start_site(app, cfg.host, cfg.port)
        log.info(
            "kvroute serving on %s (policy %s, state %s, %d replicas)",
            url,
            app[PIPELINE].name,
            "redis" if cfg.redis_url else "memory",
            len(cfg.replicas),
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


def main(argv: list[str] | None = None) -> int:
    """``python -m router.serve ...`` = ``kvroute serve ...`` without the other subcommands."""
    p = argparse.ArgumentParser(prog="kvroute serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    import sys

    sys.exit(main())
