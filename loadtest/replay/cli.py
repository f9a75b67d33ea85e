"""``kvroute replay TRACE --target URL --out DIR``: replay an agentic trace, write AgentX metrics.

TRACE is a WEKA/AgentX folder, ``.tar.gz`` or ``.json``; a Mooncake or aiperf
``mooncake_trace`` ``.jsonl[.gz]``; or ``synthetic[:key=value,...]``. Sessions play as DAGs
(subagents, join gates, capped idle gaps) on closed-loop lanes, or open loop by timestamps.
Writes ``DIR/calls.jsonl``, ``sessions.jsonl``, ``queue.jsonl`` and ``summary.json``
(P90 interactivity, tokens per GPU-second, TTFT p50/p90/p99, session completion, cache-hit
ratio next to the unlimited-cache bound, failures). See docs/replay.md.
"""

from __future__ import annotations

import argparse

from loadtest import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli_args.add_trace_args(p)
    p.add_argument("--target", required=True, help="base URL of a router or replica")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--format",
        dest="fmt",
        choices=["weka", "mooncake", "aiperf", "synthetic"],
        default=None,
        help="trace format (default: from the path)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop lanes")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds: stop starting calls after this (lanes recycle sessions "
        "until then, each play with a fresh prompt namespace)",
    )
    p.add_argument(
        "--grace", type=float, default=30.0, help="seconds in-flight calls get after --duration"
    )
    p.add_argument("--max-plays", type=int, default=None, help="session plays to start at most")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument(
        "--model-dir",
        default=None,
        help="tokenizer folder (default: the tiny model; must match the target's)",
    )
    p.add_argument("--block-size", type=int, default=32, help="the replicas' KV block size")
    cli_args.add_speedup_arg(
        p, help="the target's time compression (twins): metrics are scaled back"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="divide recorded delays by this (default: --speedup)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs behind the target")
    p.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a replica /metrics URL to sample queue depth from (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-call timeout, seconds")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32_000,
        help="the output cap every call sends, as agents do (0: none); fitted into the "
        "model's listed max_model_len",
    )
    p.add_argument(
        "--output-lengths",
        choices=("twin", "max_tokens"),
        default="twin",
        help="where the recorded output length goes: only to replica twins (vllm_xargs), or "
        "as max_tokens (an oracle input: for real vLLM replicas in tests)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from loadtest import tinymodel
    from loadtest.prompts import PromptBuilder, PromptError
    from loadtest.replay.runner import ReplayConfig, replay
    from loadtest.traces import TraceError, load_trace

    try:
        trace = load_trace(
            args.trace,
            fmt=args.fmt,
            **cli_args.trace_kwargs(args),
            seed=args.seed,
        )
        builder = PromptBuilder(
            args.model_dir or tinymodel.ensure(),
            block_size=args.block_size,
            trace_block_size=trace.block_size,
            **cli_args.prompt_kwargs(args),
        )
        cfg = ReplayConfig(
            target=args.target,
            model=args.model,
            concurrency=args.concurrency,
            duration_s=args.duration,
            grace_s=args.grace,
            max_plays=args.max_plays,
            time_scale=args.time_scale or args.speedup,
            **cli_args.play_kwargs(args),
            request_timeout_s=args.timeout,
            speedup=args.speedup,
            gpus=args.gpus,
            metrics_urls=args.metrics_url,
            progress=not args.no_progress,
            max_tokens=args.max_tokens or None,
            output_lengths=args.output_lengths,
        )
    except (TraceError, PromptError, ValueError) as e:
        print(f"kvroute replay: {e}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(replay(trace, builder, cfg, args.out))
    except RuntimeError as e:
        print(f"kvroute replay: {e}", file=sys.stderr)
        return 1
    from loadtest.report.tables import print_summary

    print_summary({"replay": summary})
    print(f"wrote {args.out}/summary.json")
    print(json.dumps({k: summary[k] for k in ("requests_ok", "requests_failed")}))
    return 0 if summary["requests_ok"] > 0 else 1
