"""Trace loaders for the replay harness.

Owns: :func:`load_trace`, which picks a loader from a trace spec:

- a folder, ``.tar.gz`` or ``.json`` of WEKA/AgentX sessions -> :mod:`loadtest.traces.weka`
- ``*.jsonl[.gz]`` -> Mooncake (:func:`loadtest.traces.mooncake.load_mooncake`), or aiperf's
  ``mooncake_trace`` (:func:`~loadtest.traces.mooncake.load_aiperf`) when ``fmt="aiperf"`` or
  the first line has a ``session_id``
- ``synthetic[:key=value,...]`` -> :func:`loadtest.traces.synthetic.generate` with those
  :class:`~loadtest.traces.synthetic.AgentXParams`

Must not import the router or HTTP clients.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

from loadtest.traces.model import Call, Dep, Session, Trace, TraceError

__all__ = ["Call", "Dep", "Session", "Trace", "TraceError", "load_trace"]


def _parse_synthetic(spec: str) -> dict[str, Any]:
    from loadtest.traces.synthetic import AgentXParams

    fields = {f.name: f.type for f in dataclasses.fields(AgentXParams)}
    out: dict[str, Any] = {}
    rest = spec.partition(":")[2]
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        k = k.strip()
        if k not in fields:
            raise TraceError(f"unknown synthetic parameter {k!r}; known: {sorted(fields)}")
        try:
            out[k] = int(v) if fields[k] in (int, "int") else float(v)
        except ValueError as e:
            raise TraceError(f"synthetic parameter {k}={v!r} is not a number") from e
    return out


def _first_line(p: Path) -> dict[str, Any]:
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    d = json.loads(line)
                except ValueError as e:
                    raise TraceError(f"{p}: first line is not JSON ({e})") from e
                return d if isinstance(d, dict) else {}
    raise TraceError(f"{p}: empty trace")


def cap_gaps(session: Session, max_gap_s: float) -> Session:
    """The session with every idle gap (dependency delay, start delay) capped. Absolute turn
    times (``Call.not_before_s``) are not gaps and stay as they are."""
    calls = [
        dataclasses.replace(
            c,
            deps=tuple(dataclasses.replace(d, delay_s=min(d.delay_s, max_gap_s)) for d in c.deps),
            start_delay_s=min(c.start_delay_s, max_gap_s),
        )
        for c in session.calls
    ]
    return dataclasses.replace(session, calls=calls)


def load_trace(
    spec: str | Path,
    *,
    fmt: str | None = None,
    max_sessions: int | None = None,
    max_calls: int | None = None,
    max_gap_s: float | None = None,
    jitter_s: float | None = None,
    seed: int = 0,
) -> Trace:
    """Load a trace from a path or a ``synthetic:...`` spec (see the module docstring)."""
    s = str(spec)
    if fmt == "synthetic" or s == "synthetic" or s.startswith("synthetic:"):
        from loadtest.traces.synthetic import AgentXParams, generate

        kw = {"seed": seed, **_parse_synthetic(s)}
        if max_sessions is not None:
            kw["sessions"] = max_sessions
        t = generate(AgentXParams(**kw))
        if max_calls is not None:
            from loadtest.traces.weka import truncate

            t.sessions = [truncate(x, max_calls) for x in t.sessions]
        if max_gap_s is not None:
            t.sessions = [cap_gaps(x, max_gap_s) for x in t.sessions]
            t.meta["max_gap_s"] = max_gap_s
        return t
    p = Path(s)
    if not p.exists():
        raise TraceError(f"no such trace: {p}")
    if fmt in (None, "weka") and (p.is_dir() or p.name.endswith((".tar.gz", ".tgz", ".json"))):
        from loadtest.traces import weka

        kw2: dict[str, Any] = {"max_sessions": max_sessions, "max_calls": max_calls}
        if max_gap_s is not None:
            kw2["max_gap_s"] = max_gap_s
        return weka.load(p, **kw2)
    if fmt in (None, "mooncake", "aiperf"):
        from loadtest.traces import mooncake

        if fmt == "aiperf" or (fmt is None and "session_id" in _first_line(p)):
            t = mooncake.load_aiperf(p, max_sessions=max_sessions)
            if max_calls is not None:
                from loadtest.traces.weka import truncate

                t.sessions = [truncate(x, max_calls) for x in t.sessions]
            return t
        kw3: dict[str, Any] = {"seed": seed, "max_requests": max_sessions}
        if jitter_s is not None:
            kw3["jitter_s"] = jitter_s
        return mooncake.load_mooncake(p, **kw3)
    raise TraceError(f"unknown trace format {fmt!r} for {p}")
