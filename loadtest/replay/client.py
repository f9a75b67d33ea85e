"""One streaming chat call, timed: the replay's HTTP client.

Owns: :func:`session_headers` (the session-identity headers of each agent convention) and
:func:`stream_chat`, which sends one ``POST /v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``, and measures TTFT (first content delta), end-to-end time and
TPOT, and reads ``usage`` (prompt/completion tokens, ``prompt_tokens_details.cached_tokens``)
and the replica that served the call from a response header. Never raises for a failed call:
the failure is the result. Must not import the router.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

CONVENTIONS = ("claude", "codex", "opencode", "dynamo", "none")
# Response headers that name the replica a router picked, in order of preference.
REPLICA_HEADERS = ("x-kvroute-replica", "x-twin-replica", "x-replica", "x-served-by")


def session_headers(
    convention: str, session: str, agent: str, parent_agent: str | None
) -> dict[str, str]:
    """Identity headers as each agent sends them (DESIGN.md, "Agent session conventions").

    ``agent`` is ``"main"`` for the root agent; subagents are identified under the session.
    """
    if convention == "none":
        return {}
    if convention == "claude":
        h = {"x-claude-code-session-id": session}
        if agent != "main":
            h["x-claude-code-agent-id"] = agent
            # a child of the main agent names no parent agent (the main agent has no agent
            # id: the router files it as the session itself); a nested one names its parent
            if parent_agent not in (None, "main"):
                h["x-claude-code-parent-agent-id"] = parent_agent
        return h
    if convention == "codex":  # Codex has no subagent lineage: one id per session
        return {"session_id": session}
    if convention == "opencode":  # subagents are child sessions
        if agent == "main":
            return {"x-session-id": session}
        parent = session if (parent_agent in (None, "main")) else f"{session}/{parent_agent}"
        return {"x-session-id": f"{session}/{agent}", "x-parent-session-id": parent}
    if convention == "dynamo":  # Dynamo's agent headers, subagents as child sessions
        if agent == "main":
            return {"x-dynamo-session-id": session}
        parent = session if (parent_agent in (None, "main")) else f"{session}/{parent_agent}"
        return {"x-dynamo-session-id": f"{session}/{agent}", "x-dynamo-parent-session-id": parent}
    raise ValueError(f"unknown session convention {convention!r}; one of {CONVENTIONS}")


@dataclass
class CallResult:
    ok: bool
    t_start: float
    t_end: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    replica: str | None = None
    status: int | None = None
    error: str | None = None


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    clock: Any = time.monotonic,
    timeout_s: float = 600.0,
) -> CallResult:
    """Send one streaming chat call and time it (see the module docstring)."""
    t0 = clock()
    first: float | None = None
    done = False
    usage: dict[str, Any] | None = None
    n_deltas = 0
    status: int | None = None
    replica: str | None = None

    def failed(error: str) -> CallResult:
        return CallResult(False, t0, clock(), status=status, replica=replica, error=error)

    try:
        async with http.post(
            url,
            data=orjson.dumps(body),
            headers={"content-type": "application/json", **headers},
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10),
        ) as resp:
            status = resp.status
            replica = next((resp.headers[h] for h in REPLICA_HEADERS if h in resp.headers), None)
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                return failed(f"http {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    ev = orjson.loads(data)
                except orjson.JSONDecodeError:
                    return failed("bad sse: undecodable data line")
                if "error" in ev:
                    return failed(f"stream error: {str(ev['error'])[:200]}")
                for ch in ev.get("choices") or ():
                    delta = ch.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        n_deltas += 1
                        if first is None:
                            first = clock()
                if ev.get("usage"):
                    usage = ev["usage"]
    except TimeoutError:
        return failed("timeout")
    except aiohttp.ClientError as e:
        return failed(f"connection: {type(e).__name__}: {e}"[:300])
    t1 = clock()
    if not done:  # cut short (replica or router died mid-stream): not a completed call
        return failed("truncated: stream ended without [DONE]")
    if first is None:
        return failed("no tokens: stream ended without content")
    n_out = int(usage.get("completion_tokens", n_deltas)) if usage else n_deltas
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return CallResult(
        ok=True,
        t_start=t0,
        t_end=t1,
        ttft_s=first - t0,
        tpot_s=(t1 - first) / (n_out - 1) if n_out >= 2 else None,
        prompt_tokens=int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None,
        completion_tokens=n_out,
        cached_tokens=int(cached) if cached is not None else None,
        replica=replica,
        status=status,
    )
