"""Retention hints for the engine plugin, from what the router knows about a session.

Owns: :func:`retention_hint` (session record -> the ``kvroute`` hint), :func:`call_hint` (the
hint a call carries, if any) and :func:`with_hint` (the request body with the hint set). Pure:
no I/O; never imports vllm or torch.

The engine plugin's host tier (``engine_patches.retention``, docs/engine.md) keeps a paused
session's KV ahead of cold blocks. It reads ``kv_transfer_params.kvroute = {session, state,
return_s}`` from the request body, where ``state`` is what the session does *after* this
call. The router predicts it:

* ``done`` — the client said the session ends (``X-Dynamo-Session-Final`` and the like:
  ``SessionIdentity.final``);
* ``waiting-on-children`` — the session has subagents (lineage in the session table): a
  parent usually waits for its children after the call that spawned them;
* ``tool-pause`` — otherwise: an agent session pauses between calls (tool runs, the user).

``return_s`` is the session's median gap between calls (None before its second call: the
engine then holds for its TTL). ``session`` is the router's table key, namespaced by tenant.
Any ``kvroute`` hint a client put in the body is replaced, so one tenant cannot hold or release
another tenant's KV.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import orjson

from router.sessions import SessionIdentity
from router.state import SessionRecord

# vLLM's OpenAI routes take ``kv_transfer_params``; its Anthropic route does not.
HINTED_ROUTES = ("/v1/chat/completions", "/v1/completions")


def retention_hint(
    identity: SessionIdentity, record: SessionRecord | None
) -> dict[str, Any] | None:
    """The hint for this call, or None for calls without a session (prefix fallback)."""
    if record is None or identity.source == "prefix":
        return None
    if identity.final or record.final:
        state = "done"
    elif record.children:
        state = "waiting-on-children"
    else:
        state = "tool-pause"
    hint: dict[str, Any] = {"session": identity.key, "state": state}
    if record.gaps and state != "done":
        hint["return_s"] = round(statistics.median(record.gaps[-8:]), 3)
    return hint


def call_hint(
    route: str, identity: SessionIdentity, record: SessionRecord | None, enabled: bool
) -> dict[str, Any] | None:
    """The hint this call carries upstream (None: hints off, a route vLLM gives no
    ``kv_transfer_params``, or no session). The KV layer keeps it (``RequestContext.hint``)
    to price the session's host-tier copy as held (:mod:`router.kv.state`)."""
    if not enabled or route not in HINTED_ROUTES:
        return None
    return retention_hint(identity, record)


def hinted_body(route: str, body: Mapping[str, Any], hint: dict[str, Any] | None) -> bytes | None:
    """The body to send upstream instead of the client's bytes, or None to send them as is:
    ``hint`` set (from :func:`call_hint`), or a client-set ``kvroute`` hint stripped."""
    if route not in HINTED_ROUTES:
        return None
    if hint is None and "kv_transfer_params" not in body:
        return None
    return with_hint(body, hint)


def with_hint(body: Mapping[str, Any], hint: dict[str, Any] | None) -> bytes:
    """The body re-serialized with ``kv_transfer_params.kvroute`` = ``hint`` (any client-set
    ``kvroute`` removed; other ``kv_transfer_params`` keys kept)."""
    out = dict(body)
    params = out.get("kv_transfer_params")
    params = dict(params) if isinstance(params, Mapping) else {}
    params.pop("kvroute", None)
    if hint is not None:
        params["kvroute"] = hint
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return orjson.dumps(out)
