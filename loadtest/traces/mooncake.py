"""Mooncake request traces and aiperf's ``mooncake_trace`` format (JSONL, optionally gzipped).

Owns: turning lines ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` into sessions.

- **Mooncake** (FAST'25 release): one request per line, 512-token blocks, ids shared across the
  whole trace (``id_scope="trace"``). Timestamps are bucketed (~3 s in the synthetic trace), so
  each arrival gets a seeded uniform jitter in ``[0, jitter_s)``. Each line becomes a
  one-call session whose ``arrival_s`` is the jittered timestamp: open loop replays honour it,
  closed loop ignores it.
- **aiperf ``mooncake_trace``**: the same fields plus optional ``session_id`` (lines of one
  session are its turns, in file order) and ``delay``; ``timestamp`` is optional. Turn timing
  follows aiperf (ai-dynamo/aiperf, ``src/aiperf/timing/strategies/fixed_schedule.py`` and
  ``request_rate.py``, ``handle_credit_return``; docs/tutorials/multi-turn.md): a later turn
  is scheduled when the previous turn's response has *ended* — ``delay`` ms after that end
  (end-to-start, not start-to-start), or at its absolute ``timestamp`` (trace time, not
  before the previous end) in aiperf's fixed schedule, which it uses when the first turn has
  a ``timestamp``; the timestamp wins when a turn has both. So a later turn with ``delay``
  depends on the previous one with that delay; one with a ``timestamp`` (in a session whose
  first turn has one) depends on it with no delay and waits until ``timestamp - first
  timestamp`` after the session start (``Call.not_before_s``). Lines with
  ``text_input``/``messages``/``payload`` carry literal prompts, which this harness does not
  replay (it synthesizes prompts from ``hash_ids``): they are rejected with a clear error.

Must not import the router or HTTP clients.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from loadtest.traces.model import Call, Dep, Session, Trace, TraceError

MOONCAKE_BLOCK_SIZE = 512
DEFAULT_JITTER_S = 3.0


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise TraceError(f"no such trace: {path}")
    opener = gzip.open if path.name.endswith(".gz") else open
    out: list[dict[str, Any]] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(d, dict):
                raise TraceError(f"{path}:{n}: not a JSON object")
            d["_line"] = n
            out.append(d)
    if not out:
        raise TraceError(f"{path}: empty trace")
    return out


def _call_fields(d: dict[str, Any], where: str) -> tuple[tuple[int, ...], int, int]:
    for k in ("text_input", "messages", "payload"):
        if k in d:
            raise TraceError(
                f"{where}: '{k}' lines carry literal prompts; this harness replays "
                "hash_ids/input_length lines only"
            )
    try:
        n_in = int(d["input_length"])
        n_out = int(d.get("output_length", 1))
        ids = tuple(int(x) for x in d.get("hash_ids", ()))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: needs input_length/output_length/hash_ids ({e!r})") from e
    if n_in <= 0:
        raise TraceError(f"{where}: input_length must be positive")
    if not ids:
        raise TraceError(f"{where}: no hash_ids (needed to synthesize a shareable prompt)")
    return ids, n_in, max(n_out, 1)


def load_mooncake(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    jitter_s: float = DEFAULT_JITTER_S,
    seed: int = 0,
    max_requests: int | None = None,
) -> Trace:
    """Mooncake JSONL: one single-call session per line, jittered arrivals (open loop)."""
    p = Path(path)
    rng = random.Random(seed)
    sessions: list[Session] = []
    for d in _lines(p):
        if max_requests is not None and len(sessions) >= max_requests:
            break
        where = f"{p}:{d['_line']}"
        ids, n_in, n_out = _call_fields(d, where)
        try:
            ts = float(d["timestamp"]) / 1000.0
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{where}: Mooncake lines need a timestamp (ms)") from e
        arrival = ts + (rng.uniform(0.0, jitter_s) if jitter_s > 0 else 0.0)
        sid = f"r{d['_line']}"
        call = Call(
            id=f"{sid}/0",
            agent="main",
            hash_ids=ids,
            input_tokens=n_in,
            output_tokens=n_out,
            recorded_s=ts,
        )
        sessions.append(Session(id=sid, calls=[call], arrival_s=arrival))
    sessions.sort(key=lambda s: s.arrival_s or 0.0)
    return Trace(
        name=p.name.removesuffix(".gz").removesuffix(".jsonl"),
        block_size=block_size,
        sessions=sessions,
        id_scope="trace",
        open_loop=True,
        meta={"format": "mooncake", "jitter_s": jitter_s, "seed": seed},
    )


def load_aiperf(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    max_sessions: int | None = None,
) -> Trace:
    """aiperf ``mooncake_trace``: lines grouped by ``session_id`` into chains of turns.

    Turn k > 0 starts after turn k-1 has *ended* (aiperf issues the next turn on the previous
    response's return): ``delay`` ms after that end, or — when turn k and the session's first
    turn carry a ``timestamp`` — not before ``timestamp_k - timestamp_0`` after the session
    start (aiperf's fixed schedule sends it at its absolute time; a timestamp wins over a
    delay, as there); otherwise right after the previous end."""
    p = Path(path)
    order: list[str] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for d in _lines(p):
        sid = str(d.get("session_id", f"r{d['_line']}"))
        if sid not in groups:
            order.append(sid)
            groups[sid] = []
        groups[sid].append(d)
    sessions: list[Session] = []
    timed = all("timestamp" in g[0] for g in groups.values())
    for sid in order[: max_sessions if max_sessions is not None else None]:
        calls: list[Call] = []
        for i, d in enumerate(groups[sid]):
            where = f"{p}:{d['_line']}"
            ids, n_in, n_out = _call_fields(d, where)
            deps: tuple[Dep, ...] = ()
            not_before: float | None = None
            first = groups[sid][0]
            if i > 0:
                delay = 0.0
                if "timestamp" in d and "timestamp" in first:  # absolute, from the session start
                    not_before = max(0.0, (float(d["timestamp"]) - float(first["timestamp"])) / 1e3)
                elif "delay" in d:  # after the previous turn's end
                    delay = max(0.0, float(d["delay"]) / 1000.0)
                deps = (Dep(calls[-1].id, delay),)
            calls.append(
                Call(
                    id=f"{sid}/{i}",
                    agent="main",
                    hash_ids=ids,
                    input_tokens=n_in,
                    output_tokens=n_out,
                    deps=deps,
                    not_before_s=not_before,
                    recorded_s=float(d.get("timestamp", 0.0)) / 1000.0,
                )
            )
        arrival = float(groups[sid][0]["timestamp"]) / 1000.0 if timed else None
        sessions.append(Session(id=sid, calls=calls, arrival_s=arrival))
    if timed:  # the open loop starts sessions in list order: make that arrival order
        sessions.sort(key=lambda x: x.arrival_s or 0.0)
    return Trace(
        name=p.name.removesuffix(".gz").removesuffix(".jsonl"),
        block_size=block_size,
        sessions=sessions,
        id_scope="trace",
        open_loop=timed,
        meta={"format": "aiperf"},
    )
