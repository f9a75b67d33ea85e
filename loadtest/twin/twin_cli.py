"""``kvroute twin``: run one simulated vLLM replica (the replica twin) on loopback.

Speaks vLLM's OpenAI-compatible API and publishes KV events in vLLM's wire format; timing
follows a replica profile (``costmodel/profiles/``) under a truth (``--truth``,
:mod:`loadtest.twin.truth`), compressed by ``--speedup``.
"""

from __future__ import annotations

import argparse

from loadtest import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    cli_args.add_profile_arg(p)
    cli_args.add_model_args(p)
    p.add_argument("--name", default="twin", help="replica name (KV-event topic kv@NAME)")
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ endpoint; tcp://H:P connects, tcp://*:P binds (as vLLM)",
    )
    p.add_argument("--kv-events-topic", default=None)
    cli_args.add_speedup_arg(p)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="bind vLLM's KV-event replay service here (e.g. tcp://127.0.0.1:5558)",
    )
    p.add_argument(
        "--digest-hashes",
        action="store_true",
        help="publish 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    p.add_argument(
        "--role",
        choices=("prefill", "decode", "both"),
        default="both",
        help="P/D disaggregation role (vLLM's kv_role: kv_producer, kv_consumer, kv_both)",
    )
    cli_args.add_reply_args(p)
    cli_args.add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from costmodel.profiles import ProfileError
    from loadtest import tinymodel
    from loadtest.twin.publisher import publisher_binds
    from loadtest.twin.replica import TwinConfig, TwinReplica
    from loadtest.twin.server import runner_port, serve

    try:
        prof = cli_args.profile_from_args(args)
        plugin = cli_args.plugin_from_args(args)
        cfg = TwinConfig(
            profile=prof,
            model_dir=Path(args.model or tinymodel.ensure()),
            name=args.name,
            served_model_name=args.served_model_name,
            speedup=args.speedup,
            kv_events_endpoint=args.kv_events,
            kv_events_topic=args.kv_events_topic,
            max_model_len=args.max_model_len,
            int_hashes=not args.digest_hashes,
            kv_events_replay=args.kv_events_replay,
            plugin=plugin,
            truth=args.truth,
            role=args.role,
            host=args.host,
            **cli_args.reply_kwargs(args),
        )
    except (ProfileError, ValueError) as e:
        print(f"kvroute twin: {e}")
        return 2

    async def main() -> None:
        twin = TwinReplica(cfg)
        if twin.publisher is not None and not publisher_binds(twin.publisher.endpoint):
            twin.publisher.wait_subscribed(1.0)  # so the first events are not dropped
        runner = await serve(twin, args.host, args.port)
        cfg.port = runner_port(runner)  # where a decode replica reads this one's KV
        print(
            f"twin {cfg.name} ({prof.name}, role {cfg.role}, truth {args.truth}, "
            f"speedup {cfg.speedup}) on "
            f"http://{args.host}:{runner_port(runner)}",
            flush=True,
        )
        if twin.publisher is not None:
            replay = twin.publisher.replay_endpoint or "-"
            print(f"kv-events {twin.topic} {twin.publisher.endpoint} {replay}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return 0
