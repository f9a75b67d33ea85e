"""The twin against an engine model nobody here wrote: NVIDIA Dynamo's mocker (issue 42).

Replays the same weka-dev Claude Code sessions through

(a) Dynamo's mocker, ``dynamo._core.run_mocker_trace_replay`` (``ai-dynamo-runtime`` 1.6.1,
    offline replay, ``trace_format="weka"``, ``router_mode="kv_router"``: Dynamo's own KV router
    with its defaults), run in the Dynamo venv by subprocess (the main venv has no dynamo), its
    engine set from the twin's profile as far as its knobs go: ``block_size``,
    ``num_gpu_blocks`` (the profile's HBM pool per replica), ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, one worker per replica; its timing model
    is its built-in ``polynomial`` (the wheel has no ``aisimulate`` perf database, so no
    per-GPU model can be named: the figures are the mocker's own physics, not H200 ones);
(b) the project's simulator (``loadtest.sim.trace.simulate_trace``: the twin's engine model)
    with the same profile and replicas and kvroute's ``kv_cost``, closer to Dynamo's KV router
    (prefix overlap against load) than any other policy here.

Arrivals: the mocker's weka importer replays every session once over ``agentic_lanes`` lanes
with the recorded idle gaps (it has no gap cap); the twin plays every session once
(``max_plays``) over as many lanes with its gaps uncapped too (``max_gap_s=inf``). The
mocker's weka replay has no seed, but its KV-router runs are not repeatable (the hit ratio
moves by ~0.1 point run to run; one worker repeats exactly), so it runs 3 times; the twin's
seed orders which lane takes which session (3 seeds).

Reported side by side: the prompt-token hit ratio (tokens served from cache / prompt tokens),
TTFT p50/p90/p99 and a quantile table (the CDF), TPOT p50/p90, output tokens per GPU-second over
the simulated span. Differences explained: docs/twin.md "Against Dynamo's mocker".

Run: ``python -m loadtest.benchmarks --only bench_mocker`` (or ``--quick``: 24 sessions).
Needs the Dynamo venv (``scripts/setup_peers.sh``; ``$KVROUTE_DYNAMO_VENV`` overrides).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SLOW = "replays weka-dev through Dynamo's mocker (Dynamo venv) and the twin: ~5 min"

TRACES = Path(
    os.environ.get("KVROUTE_TRACES")
    or Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
)
DYNAMO_VENV = Path(
    os.environ.get("KVROUTE_DYNAMO_VENV")
    or Path.home() / ".cache" / "kvroute" / "peers-dynamo-1.6.1"
)
PROFILE = "h200-70b-fp8-tp4"
REPLICAS = 4
LANES = 16
SEEDS = (0, 1, 2)
# the mocker's weka replay takes no seed, yet its KV-router runs differ run to run (its
# one-worker runs repeat exactly): repeated like seeds
MOCKER_REPEATS = 3
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
# the target model name the mocker's agentic (weka) replay requires; it only labels the run
MOCKER_MODEL = "llama-70b"

# Runs inside the Dynamo venv: argv[1] a JSON of the call's arguments, argv[2] the output file
# (one JSON object: the summary and the per-request fields the comparison needs).
MOCKER_SCRIPT = r"""
import json, sys, time
from dynamo._core import run_mocker_trace_replay
a = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
r = run_mocker_trace_replay(
    [a["trace_dir"]], extra_engine_args=a["engine"], num_workers=a["workers"],
    router_mode="kv_router", trace_format="weka", model_name=a["model"],
    execution_model=a["model"], agentic_lanes=a["lanes"], capture_per_request=True)
keep = ("ttft_ms", "itl_ms", "input_length", "output_length", "reused_input_tokens",
        "arrival_time_ms", "first_token_ms", "last_token_ms", "decode_worker_idx")
per = [{k: q.get(k) for k in keep} for q in (r.per_request or [])]
summ = {k: v for k, v in r.summary.items() if not isinstance(v, (list, dict))}
json.dump({"summary": summ, "per_request": per, "wall_s": time.perf_counter() - t0},
          open(sys.argv[2], "w"))
"""


# Runs inside the Dynamo venv: the mocker's timing model alone, one worker, ``b`` requests of
# ``isl`` prompt tokens (no cache) arriving at once, 1025 output tokens: median TTFT and ITL (ms)
PROBE_SCRIPT = r"""
import json, sys
from dynamo._core import run_mocker_synthetic_trace_replay as replay
a = json.load(open(sys.argv[1]))
out = []
for isl, b in a["points"]:
    s = replay(isl, 1025, b, extra_engine_args=a["engine"], num_workers=1,
               arrival_interval_ms=0.0).summary
    out.append({"isl": isl, "batch": b, "ttft_ms": s["median_ttft_ms"],
                "itl_ms": s["median_itl_ms"]})
json.dump(out, open(sys.argv[2], "w"))
"""
PROBE_POINTS = ((1024, 1), (8192, 1), (32768, 1), (131072, 1), (8192, 16), (8192, 64),
                (32768, 16), (32768, 64))  # fmt: skip


def dynamo_python(venv: Path = DYNAMO_VENV) -> Path | None:
    """The Dynamo venv's interpreter, or None where it is not installed."""
    py = venv / "bin" / "python"
    return py if py.is_file() else None


def mocker_engine_args(profile: Any) -> dict[str, Any]:
    """The mocker's canonical engine config from a twin profile: what its knobs can take."""
    return {
        "engine": {
            "backend": "vllm",
            "block_size": int(profile.block_size),
            "num_gpu_blocks": int(profile.gpu_kv_blocks),
            "max_num_seqs": int(profile.max_num_seqs),
            "max_num_batched_tokens": int(profile.max_num_batched_tokens),
            # the twin refuses a call whose prompt + output exceeds it (165 weka-dev calls)
            "max_model_len": int(profile.model.max_model_len),
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
        }
    }


def _request_models(reqs: Iterable[dict[str, Any]], acc: set[str]) -> set[str]:
    for r in reqs:
        if r.get("model"):
            acc.add(str(r["model"]))
        if isinstance(r.get("requests"), list):
            _request_models(r["requests"], acc)
    return acc


def prepare_weka_dir(src: Path, dest: Path, max_sessions: int | None = None) -> list[str]:
    """Write ``src``'s session files (a ``.tar.gz`` or folder) into ``dest`` for the mocker,
    the first ``max_sessions`` by name; returns their stems. Each file's ``models`` list is
    widened to the models its requests use: the mocker rejects a file whose requests name a
    model its header does not declare (8 weka-dev files call a Haiku the header omits), and
    the model is only a label to both simulators."""
    dest.mkdir(parents=True, exist_ok=True)
    docs: list[tuple[str, bytes]] = []
    if src.is_dir():
        docs = [(p.name, p.read_bytes()) for p in sorted(src.rglob("*.json"))]
    else:
        with tarfile.open(src) as tf:
            members = sorted(
                (m for m in tf.getmembers() if m.isfile() and m.name.endswith(".json")),
                key=lambda m: m.name,
            )
            for m in members:
                f = tf.extractfile(m)
                assert f is not None
                docs.append((Path(m.name).name, f.read()))
    docs = docs[:max_sessions] if max_sessions else docs
    for name, raw in docs:
        d = json.loads(raw)
        if isinstance(d.get("models"), list):
            d["models"] = sorted(set(d["models"]) | _request_models(d.get("requests", []), set()))
        (dest / name).write_text(json.dumps(d))
    return [Path(n).stem for n, _ in docs]


def quantiles(xs: Sequence[float], qs: Sequence[float] = QUANTILES) -> dict[str, float]:
    """``{"p10": ..., "p50": ...}`` of ``xs`` (NaN when empty)."""
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=float)
    return {
        f"p{round(q * 100):d}": float(np.quantile(a, q)) if a.size else float("nan") for q in qs
    }


def summarize(calls: Sequence[dict[str, Any]], span_s: float, gpus: int) -> dict[str, Any]:
    """One side's figures from per-call dicts with ``ttft_s``, ``tpot_s`` (None under 2
    output tokens), ``prompt_tokens``, ``cached_tokens``, ``output_tokens``: the prompt-token
    hit ratio, TTFT and TPOT quantiles (seconds) and output tokens per GPU-second over
    ``span_s``."""
    prompt = sum(c["prompt_tokens"] for c in calls)
    cached = sum(c["cached_tokens"] for c in calls)
    out = sum(c["output_tokens"] for c in calls)
    return {
        "calls": len(calls),
        "hit_ratio": cached / prompt if prompt else float("nan"),
        "ttft_s": quantiles([c["ttft_s"] for c in calls]),
        "tpot_s": quantiles([c["tpot_s"] for c in calls], (0.5, 0.9)),
        "out_tok_per_gpu_s": out / (span_s * gpus) if span_s > 0 and gpus else float("nan"),
        "span_s": span_s,
    }


def mocker_calls(per_request: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """The mocker's per-request records -> per-call dicts for :func:`summarize`, and the span
    (first arrival to last token, seconds). TPOT = (last - first token) / (output - 1), the
    twin's definition (the mocker's ``itl_ms`` is the same mean for one request)."""
    calls: list[dict[str, Any]] = []
    t0, t1 = math.inf, -math.inf
    for q in per_request:
        if q.get("ttft_ms") is None:
            continue  # never produced a first token
        n_out = int(q.get("output_length") or 0)
        first, last = q.get("first_token_ms"), q.get("last_token_ms")
        tpot = (
            (last - first) / 1000.0 / (n_out - 1)
            if n_out >= 2 and first is not None and last is not None
            else None
        )
        calls.append({
            "ttft_s": q["ttft_ms"] / 1000.0, "tpot_s": tpot,
            "prompt_tokens": int(q["input_length"]),
            "cached_tokens": int(q.get("reused_input_tokens") or 0),
            "output_tokens": n_out,
        })  # fmt: skip
        if q.get("arrival_time_ms") is not None:
            t0 = min(t0, q["arrival_time_ms"] / 1000.0)
        if last is not None:
            t1 = max(t1, last / 1000.0)
    return calls, (t1 - t0 if calls and t1 > t0 else 0.0)


def twin_calls(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The simulator's :class:`~loadtest.sim.records.CallRecord` s -> per-call dicts."""
    keys = ("prompt_tokens", "cached_tokens", "output_tokens")
    return [
        {"ttft_s": r.ttft, "tpot_s": r.tpot, **{k: getattr(r, k) for k in keys}} for r in records
    ]


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": float(np.median(xs)), "max": max(xs)}


def side_by_side(
    mockers: Sequence[dict[str, Any]], twins: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rows ``{metric, mocker: {min, median, max}, twin: {...}, twin_over_mocker}`` (the ratio
    of the medians) over the mocker's repeats and the twin's seeds: the hit ratio, every TTFT
    quantile, TPOT p50/p90, output tokens per GPU-second."""
    first = mockers[0]
    keys: list[tuple[str, Any]] = [("hit_ratio", lambda s: s["hit_ratio"])]
    keys += [(f"ttft_{q}_s", lambda s, q=q: s["ttft_s"][q]) for q in first["ttft_s"]]
    keys += [(f"tpot_{q}_s", lambda s, q=q: s["tpot_s"][q]) for q in first["tpot_s"]]
    keys += [("out_tok_per_gpu_s", lambda s: s["out_tok_per_gpu_s"])]
    rows = []
    for name, get in keys:
        m = spread([float(get(s)) for s in mockers])
        t = spread([float(get(s)) for s in twins])
        ratio = t["median"] / m["median"] if m["median"] else float("nan")
        rows.append({"metric": name, "mocker": m, "twin": t, "twin_over_mocker": ratio})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The side-by-side rows as a Markdown table (median [min–max] over repeats / seeds)."""
    out = [
        "| metric | mocker median [min–max] | twin median [min–max] | twin/mocker |",
        "|---|---|---|---|",
    ]

    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.4g} [{x['min']:.4g}–{x['max']:.4g}]"

    for r in rows:
        out.append(
            f"| {r['metric']} | {cell(r['mocker'])} | {cell(r['twin'])} "
            f"| {r['twin_over_mocker']:.3g} |"
        )
    return "\n".join(out)


def _in_dynamo(script: str, args: dict[str, Any], py: Path, timeout_s: float) -> Any:
    with tempfile.TemporaryDirectory() as td:
        a, out = Path(td) / "args.json", Path(td) / "out.json"
        a.write_text(json.dumps(args))
        proc = subprocess.run(
            [str(py), "-c", script, str(a), str(out)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"mocker failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def timing_probe(profile: Any, py: Path) -> list[dict[str, Any]]:
    """The two timing models on the same points: the mocker's median TTFT (one request: its
    prefill; a batch: the batch's prefills queue) and median ITL, beside the twin's
    ``costmodel.steptime`` request prefill time and decode step at the batch's mean context
    (prompt + half the output)."""
    from costmodel import steptime

    got = _in_dynamo(PROBE_SCRIPT, {"engine": mocker_engine_args(profile),
                                    "points": PROBE_POINTS}, py, 300.0)  # fmt: skip
    for g in got:
        isl, b = g["isl"], g["batch"]
        g["twin_prefill_ms"] = 1000 * steptime.request_prefill_time(profile, isl, 0)
        g["twin_decode_step_ms"] = 1000 * steptime.decode_step_time(profile, b, b * (isl + 512))
    return got


def run_mocker(trace_dir: Path, engine: dict[str, Any], workers: int, lanes: int,
               py: Path, timeout_s: float = 540.0) -> dict[str, Any]:  # fmt: skip
    """Dynamo's mocker over ``trace_dir`` in the Dynamo venv; its parsed output."""
    args = {"trace_dir": str(trace_dir), "engine": engine, "workers": workers,
            "lanes": lanes, "model": MOCKER_MODEL}  # fmt: skip
    return _in_dynamo(MOCKER_SCRIPT, args, py, timeout_s)


def hit_decomposition(trace_dir: Path, engine: dict[str, Any], py: Path) -> dict[str, float]:
    """The mocker's hit ratio with KV made unlimited (4M blocks): on one worker (its own
    trace bound: no routing, no eviction) and on ``REPLICAS`` workers behind its KV router (the
    routing loss alone); the main run's is the routing and eviction loss together."""
    big = {"engine": {**engine["engine"], "num_gpu_blocks": 4_000_000}}
    out = {}
    for name, workers in (("one_worker_unlimited_kv", 1), ("kv_router_unlimited_kv", REPLICAS)):
        calls, _ = mocker_calls(run_mocker(trace_dir, big, workers, LANES, py)["per_request"])
        out[name] = summarize(calls, 1.0, 1)["hit_ratio"]
    return out


def run_twin(trace_dir: Path, sessions: int, seed: int) -> tuple[dict[str, Any], float]:
    """The project's simulator over the same sessions: every session once over ``LANES``
    lanes, gaps uncapped, kv_cost at upstream's 50 ms load refresh."""
    from costmodel.profiles import load_profile
    from loadtest.sim.router_policy import RouterPolicy
    from loadtest.sim.trace import simulate_trace
    from loadtest.traces import load_trace

    prof = load_profile(PROFILE)
    trace = load_trace(trace_dir, max_gap_s=math.inf)
    t0 = time.perf_counter()
    res = simulate_trace(
        prof, REPLICAS, trace,
        RouterPolicy("kv_cost", prof, seed=seed, scrape_interval_s=0.05),
        concurrency=LANES, max_plays=sessions, seed=seed,
    )  # fmt: skip
    calls = twin_calls(res.records)
    first = min(r.arrival for r in res.records)
    last = max(r.finish for r in res.records)
    return summarize(calls, last - first, res.gpus), time.perf_counter() - t0


def run(quick: bool = False) -> list[dict[str, Any]]:
    py = dynamo_python()
    src = TRACES / "weka-dev.tar.gz"
    if py is None:
        return [{"name": "mocker: skipped", "reason": f"no Dynamo venv at {DYNAMO_VENV}"}]
    if not src.is_file():
        return [{"name": "mocker: skipped", "reason": f"no trace at {src}"}]
    from costmodel.profiles import load_profile

    prof = load_profile(PROFILE)
    engine = mocker_engine_args(prof)
    with tempfile.TemporaryDirectory() as td:
        tdir = Path(td) / "weka"
        names = prepare_weka_dir(src, tdir, 24 if quick else None)
        mocks, m_walls, m_hits = [], [], []
        for _ in range(1 if quick else MOCKER_REPEATS):
            t0 = time.perf_counter()
            mo = run_mocker(tdir, engine, REPLICAS, LANES, py)
            m_walls.append(round(time.perf_counter() - t0, 1))
            m_calls, m_span = mocker_calls(mo["per_request"])
            mocks.append(summarize(m_calls, m_span, REPLICAS * prof.gpus))
            m_hits.append(mo["summary"].get("prefix_cache_reused_ratio"))
        extra: dict[str, Any] = {}
        from loadtest.bench.bench_kv_policy import trace_bound
        from loadtest.traces import load_trace

        extra["twin_hit_bound"] = trace_bound(load_trace(tdir, max_gap_s=math.inf), prof.block_size)
        if not quick:
            extra["mocker_hit_decomposition"] = hit_decomposition(tdir, engine, py)
            extra["timing_probe"] = timing_probe(prof, py)
        twins, walls = [], []
        for s in SEEDS[:1] if quick else SEEDS:
            tw, w = run_twin(tdir, len(names), s)
            twins.append(tw)
            walls.append(round(w, 1))
    rows = side_by_side(mocks, twins)
    print(table(rows))
    head = {
        "name": "mocker_vs_twin", "profile": PROFILE, "replicas": REPLICAS, "lanes": LANES,
        "sessions": len(names), "engine": engine["engine"],
        "mocker": mocks, "mocker_wall_s": m_walls, "mocker_summary_hit": m_hits,
        "twin_seeds": list(SEEDS[:1] if quick else SEEDS), "twin": twins, "twin_wall_s": walls,
        **extra,
    }  # fmt: skip
    return [head, *({"name": f"mocker_vs_twin:{r['metric']}", **r} for r in rows)]


if __name__ == "__main__":
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=1, default=str))
