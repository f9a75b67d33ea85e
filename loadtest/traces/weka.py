"""WEKA / AgentX session traces (Claude Code sessions, one JSON object per file).

Owns: reading a file, a folder or a ``.tar.gz`` of session files and rebuilding each session
as a DAG the way AgentX replays it:

- the main chain runs in recorded order; each call waits for the previous one to end plus the
  recorded idle gap (end-to-start: ``think_time`` when present, else ``t - (t_prev +
  api_time_prev)``), capped at ``max_gap_s``;
- a subagent spawns after the last parent call that started before it (same end-to-start
  delay rule, capped), and runs its own chain;
- the first parent call at or after the subagent's end (``t + duration_ms``) waits for the
  subagent's last call (join gate); a subagent that ends after the last parent call joins
  nothing;
- subagent ``t`` inside a subagent may be relative to its start (older files) or absolute:
  absolute times are detected (first inner ``t`` at or after the subagent's ``t``) and made
  relative.

Format: ``../shared/data/README.md``. Must not import the router or HTTP clients.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from loadtest.traces.model import Call, Dep, Session, Trace, TraceError

DEFAULT_MAX_GAP_S = 60.0


def _iter_docs(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, parsed JSON) for every session file under ``path``, sorted by name."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.json") if p.is_file())
        if not files:
            raise TraceError(f"no *.json session files under {path}")
        for p in files:
            yield p.stem, _parse(p.read_bytes(), str(p))
    elif path.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(path) as tf:
            members = sorted(
                (m for m in tf.getmembers() if m.isfile() and m.name.endswith(".json")),
                key=lambda m: m.name,
            )
            if not members:
                raise TraceError(f"no *.json session files in {path}")
            for m in members:
                f = tf.extractfile(m)
                assert f is not None
                yield Path(m.name).stem, _parse(f.read(), f"{path}:{m.name}")
    elif path.is_file():
        yield path.stem, _parse(path.read_bytes(), str(path))
    else:
        raise TraceError(f"no such trace: {path}")


def _parse(raw: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.load(io.BytesIO(raw))
    except ValueError as e:
        raise TraceError(f"{where}: not JSON ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(f"{where}: not a WEKA/AgentX session (no 'requests' list)")
    return doc


def _gap(prev: dict[str, Any] | None, cur_t: float, think: float | None, cap: float) -> float:
    """End-to-start idle gap before a call, capped at ``cap`` and never negative."""
    if think is not None:
        gap = float(think)
    elif prev is None:
        gap = cur_t
    else:
        gap = cur_t - (float(prev.get("t", 0.0)) + float(prev.get("api_time", 0.0)))
    return min(max(gap, 0.0), cap)


def _req_fields(r: dict[str, Any], where: str) -> tuple[tuple[int, ...], int, int]:
    try:
        ids = tuple(int(x) for x in r["hash_ids"])
        n_in = int(r["in"])
        n_out = int(r["out"])
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{where}: request lacks hash_ids/in/out ({e!r})") from e
    if n_in <= 0 or not ids:
        raise TraceError(f"{where}: request with no input")
    return ids, n_in, max(n_out, 1)


def _build_chain(
    requests: list[dict[str, Any]],
    *,
    agent: str,
    parent_agent: str | None,
    prefix_group: str,
    prefix_tokens: int,
    block_size: int,
    max_gap_s: float,
    first_deps: tuple[Dep, ...],
    first_delay_s: float,
    calls: list[Call],
    where: str,
) -> list[str]:
    """Append ``agent``'s chain and, recursively, its subagents to ``calls``.

    Emits calls in a topological order: a subagent's calls right after the parent call that
    spawns it, so the parent call that joins it (later) comes after them. Returns the ids of
    this agent's own calls.
    """
    main = [r for r in requests if r.get("type") != "subagent"]
    subs = [r for r in requests if r.get("type") == "subagent"]
    main_t = [float(r.get("t", 0.0)) for r in main]
    main_end = [t + float(r.get("api_time", 0.0)) for t, r in zip(main_t, main, strict=True)]
    prefix_blocks = prefix_tokens // block_size
    joins: dict[int, list[Dep]] = {}  # main-call index -> join gates
    by_spawn: dict[int, list[dict[str, Any]]] = {}
    for s in subs:
        st = float(s.get("t", 0.0))
        spawn = max((i for i, t in enumerate(main_t) if t <= st), default=-1)
        by_spawn.setdefault(spawn, []).append(s)

    def emit_subs(spawn: int, spawn_call: str | None) -> None:
        for s in by_spawn.get(spawn, []):
            st = float(s.get("t", 0.0))
            inner = list(s.get("requests") or [])
            if not inner:
                continue
            if st > 0 and float(inner[0].get("t", 0.0)) >= st - 1e-6:
                inner = [{**r, "t": float(r.get("t", 0.0)) - st} for r in inner]
            name = str(s.get("agent_id") or f"sub{len(calls)}")
            sub_agent = name if agent == "main" else f"{agent}>{name}"
            if spawn_call is None:  # starts before any parent call: from the session start
                deps: tuple[Dep, ...] = ()
                delay = min(max(st, 0.0), max_gap_s)
            else:
                deps = (Dep(spawn_call, min(max(st - main_end[spawn], 0.0), max_gap_s)),)
                delay = 0.0
            sub_ids = _build_chain(
                inner,
                agent=sub_agent,
                parent_agent=agent,
                prefix_group=str(s.get("subagent_type") or "subagent"),
                prefix_tokens=int(s.get("tool_tokens", 0) or 0)
                + int(s.get("system_tokens", 0) or 0),
                block_size=block_size,
                max_gap_s=max_gap_s,
                first_deps=deps,
                first_delay_s=delay,
                calls=calls,
                where=where,
            )
            end = st + float(s.get("duration_ms", 0.0) or 0.0) / 1000.0
            join = next((i for i, t in enumerate(main_t) if t >= end and i > spawn), None)
            if join is not None and sub_ids:
                joins.setdefault(join, []).append(Dep(sub_ids[-1], 0.0))

    ids_out: list[str] = []
    emit_subs(-1, None)
    for i, r in enumerate(main):
        hid, n_in, n_out = _req_fields(r, f"{where} {agent}[{i}]")
        cid = f"{agent}/{i}"
        if i == 0:
            deps = first_deps
        else:
            gap = _gap(main[i - 1], main_t[i], r.get("think_time"), max_gap_s)
            deps = (Dep(ids_out[-1], gap),)
        calls.append(
            Call(
                id=cid,
                agent=agent,
                hash_ids=hid,
                input_tokens=n_in,
                output_tokens=n_out,
                deps=deps + tuple(joins.pop(i, [])),
                start_delay_s=first_delay_s if i == 0 else 0.0,
                recorded_s=main_t[i],
                prefix_blocks=min(prefix_blocks, len(hid)),
                prefix_group=prefix_group,
                parent_agent=parent_agent,
            )
        )
        ids_out.append(cid)
        emit_subs(i, cid)
    return ids_out


def session_from_doc(
    doc: dict[str, Any],
    name: str,
    *,
    block_size: int | None = None,
    max_gap_s: float = DEFAULT_MAX_GAP_S,
) -> Session:
    bs = int(doc.get("block_size") or block_size or 64)
    calls: list[Call] = []
    prefix = int(doc.get("tool_tokens", 0) or 0) + int(doc.get("system_tokens", 0) or 0)
    sid = str(doc.get("id") or name)
    _build_chain(
        list(doc["requests"]),
        agent="main",
        parent_agent=None,
        prefix_group="main",
        prefix_tokens=prefix,
        block_size=bs,
        max_gap_s=max_gap_s,
        first_deps=(),
        first_delay_s=0.0,
        calls=calls,
        where=sid,
    )
    if not calls:
        raise TraceError(f"{sid}: session has no calls")
    return Session(id=sid, calls=calls, meta={"block_size": bs, "models": doc.get("models")})


def load(
    path: str | Path,
    *,
    max_gap_s: float = DEFAULT_MAX_GAP_S,
    max_sessions: int | None = None,
    max_calls: int | None = None,
    names: Iterable[str] | None = None,
) -> Trace:
    """Load WEKA/AgentX sessions from a file, folder or ``.tar.gz``.

    ``max_calls`` keeps each session's first calls (by order in the session's DAG, dropping
    any call whose dependencies were dropped) — for quick replays.
    """
    p = Path(path)
    wanted = set(names) if names is not None else None
    sessions: list[Session] = []
    block_sizes: set[int] = set()
    for name, doc in _iter_docs(p):
        if wanted is not None and name not in wanted and str(doc.get("id")) not in wanted:
            continue
        s = session_from_doc(doc, name, max_gap_s=max_gap_s)
        if max_calls is not None:
            s = truncate(s, max_calls)
        sessions.append(s)
        block_sizes.add(int(s.meta["block_size"]))  # type: ignore[call-overload]
        if max_sessions is not None and len(sessions) >= max_sessions:
            break
    if not sessions:
        raise TraceError(f"no sessions selected from {p}")
    if len(block_sizes) != 1:
        raise TraceError(f"{p}: sessions disagree on block_size: {sorted(block_sizes)}")
    return Trace(
        name=p.name.removesuffix(".tar.gz"),
        block_size=block_sizes.pop(),
        sessions=sessions,
        id_scope="session",
        meta={"format": "weka", "max_gap_s": max_gap_s},
    )


def truncate(s: Session, max_calls: int) -> Session:
    """The first ``max_calls`` calls of ``s`` whose dependencies are all kept."""
    kept: list[Call] = []
    ids: set[str] = set()
    for c in s.calls:
        if len(kept) >= max_calls:
            break
        if all(d.call in ids for d in c.deps):
            kept.append(c)
            ids.add(c.id)
    return Session(id=s.id, calls=kept, meta=dict(s.meta))
