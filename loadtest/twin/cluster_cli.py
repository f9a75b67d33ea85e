"""``kvroute cluster``: N replica twins in one process on consecutive loopback ports.

The embedded cluster behind ``make demo``: every twin speaks vLLM's API and publishes KV
events (topic ``kv@<prefix>-<i>``) to one endpoint.
"""

from __future__ import annotations

import argparse

from loadtest import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--roles",
        default=None,
        help="comma-separated P/D role per replica (prefill, decode, both; default all both)",
    )
    cli_args.add_profile_arg(p)
    p.add_argument("--base-port", type=int, default=0, help="0: free ports")
    p.add_argument("--host", default="127.0.0.1")
    cli_args.add_model_args(p)
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ endpoint the replicas connect to (a subscriber binds it); "
        "tcp://127.0.0.1:* makes each replica bind its own port (printed)",
    )
    p.add_argument(
        "--kv-events-topic",
        default=None,
        metavar="TOPIC",
        help="every replica's KV-event topic (\"\" is vLLM's default; default: kv@<name>)",
    )
    cli_args.add_speedup_arg(p)
    p.add_argument("--name-prefix", default="twin")
    cli_args.add_engine_args(p)
    p.add_argument(
        "--kv-events-replay",
        action="store_true",
        help="give every replica vLLM's replay service on its own loopback port",
    )
    cli_args.add_reply_args(p)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from costmodel.profiles import ProfileError
    from loadtest.twin.cluster import start_cluster

    async def main() -> None:
        prof = cli_args.profile_from_args(args)
        async with start_cluster(
            args.replicas,
            prof,
            speedup=args.speedup,
            base_port=args.base_port,
            host=args.host,
            kv_events=args.kv_events,
            kv_events_topic=args.kv_events_topic,
            model_dir=args.model,
            served_model_name=args.served_model_name,
            name_prefix=args.name_prefix,
            kv_events_replay=args.kv_events_replay,
            plugin=cli_args.plugin_from_args(args),
            truth=args.truth,
            roles=[r.strip() for r in args.roles.split(",")] if args.roles else None,
            **cli_args.reply_kwargs(args),
        ) as c:
            for name, url in zip(c.names, c.urls, strict=True):
                print(f"{name} {url}", flush=True)
            if args.kv_events:
                rows = zip(c.names, c.topics, c.event_endpoints, c.replay_endpoints, strict=True)
                for name, topic, ep, replay in rows:
                    topic = topic or '""'  # vLLM's default, the empty topic: keep the columns
                    print(f"kv-events {name} {topic} {ep} {replay or '-'}", flush=True)
            await asyncio.Event().wait()

    try:
        asyncio.run(main())
    except (ProfileError, ValueError) as e:
        print(f"kvroute cluster: {e}")
        return 2
    return 0
