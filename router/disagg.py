"""Prefill/decode disaggregation: which replicas serve which leg, and whether to split a call.

Owns: the role split of the replica set (``URL#role=prefill|decode|both``,
:func:`router.urls.split_role`), the decode replica's choice (:func:`pick_decode`), the
per-call verdict (:func:`plan`, the inputs gathered from the KV layer's view and priced by
the pure :func:`costmodel.disagg.disagg_cost`) and the two legs' bodies in vLLM's
``kv_transfer_params`` protocol (:func:`prefill_body`, :func:`decode_body`). The HTTP legs
themselves are :func:`router.proxy_pd.forward_pd`'s. Must not import aiohttp, torch or vllm.

Protocol, as vLLM's NIXL connector expects it and as vLLM's own toy P/D proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``) and vllm-router's P/D mode
send it: the prefill leg is the client's body with ``stream: false``, ``max_tokens: 1``
(and ``max_completion_tokens: 1`` when the client set it), no ``stream_options``, and
``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
"remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``;
its JSON answer carries ``kv_transfer_params`` (vLLM's ``NixlConnectorScheduler.
request_finished``: ``do_remote_prefill: true``, ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``, ...), which the decode
leg — the client's own body otherwise unchanged — sends back as its ``kv_transfer_params``.
Both legs carry the same ``X-Request-Id``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from costmodel.disagg import DisaggTerms, disagg_cost
from costmodel.placement import queue_time
from router.replicas import EndpointView
from router.scheduling import RequestContext

# the routes a P/D split applies to (vLLM's connector path serves these two)
PD_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})
KV_FULL = 0.95  # a decode replica this full is chosen only when no other has room
CHARS_PER_TOKEN = 4.0  # without a KV layer: the prompt's size from its body's bytes


def pd_enabled(views: Iterable[Any]) -> bool:
    """Whether the set is disaggregated: some replica (an :class:`EndpointView` or a
    :class:`router.replicas.Replica`) has a role other than ``both``."""
    return any(v.role != "both" for v in views)


def not_prefill(views: Iterable[EndpointView]) -> frozenset[str]:
    """Names that may not take a prefill leg (decode-only replicas)."""
    return frozenset(v.name for v in views if v.role not in PREFILL_ROLES)


def not_decode(views: Iterable[EndpointView]) -> frozenset[str]:
    """Names that may not take a decode leg or a colocated call (prefill-only replicas)."""
    return frozenset(v.name for v in views if v.role not in DECODE_ROLES)


def pick_decode(
    ctx: RequestContext, views: Iterable[EndpointView], excluded: frozenset[str] = frozenset()
) -> EndpointView | None:
    """The decode replica for ``ctx``: healthy, accepting, serving the model, role decode or
    both, not ``excluded``; fewest requests first, then most KV room (a replica whose KV is
    at least ``KV_FULL`` used only when none has room); ties by name (stable)."""
    best: tuple[Any, ...] | None = None
    pick = None
    for v in views:
        if v.role not in DECODE_ROLES or v.name in excluded or not v.healthy or not v.accepting:
            continue
        if ctx.model and v.models and ctx.model not in v.models:
            continue
        usage = v.kv_usage if v.kv_usage is not None else 0.0
        key = (usage >= KV_FULL, v.load, usage, v.name)
        if best is None or key < best:
            best, pick = key, v
    return pick


def plan(
    ctx: RequestContext,
    prefill: EndpointView,
    decode: EndpointView,
    kv: Any,
    *,
    mode: str = "auto",
    min_prompt_tokens: int = 0,
    body_bytes: int = 0,
) -> DisaggTerms | None:
    """Whether to split ``ctx`` over ``prefill`` → ``decode`` (``mode`` ``auto``: priced by
    :func:`costmodel.disagg.disagg_cost` from the KV layer's view ``kv``). ``always`` /
    ``never`` skip the pricing (None). Without a KV layer the prompt's size is guessed from the
    body (``body_bytes`` / ``CHARS_PER_TOKEN``) and only ``min_prompt_tokens`` decides."""
    if mode != "auto":
        return None
    if prefill.name == decode.name:
        return DisaggTerms(False, "same_replica", 0.0, 0.0, 0.0, 0, 0.0)
    if kv is None:
        n = int(ctx.prompt_tokens or body_bytes / CHARS_PER_TOKEN)
        split = n >= min_prompt_tokens
        return DisaggTerms(split, "size_only" if split else "short_prompt", 0.0, 0.0, 0.0, n, 0.0)
    keys = ctx.block_keys or []
    if keys:
        n_tok = int(ctx.prompt_tokens or len(keys) * kv.block_size)
        matches = kv.match(keys, [prefill.name, decode.name])
    else:
        n_tok, matches = kv.estimate(ctx)
        n_tok = int(n_tok or ctx.prompt_tokens or body_bytes / CHARS_PER_TOKEN)
    pm, dm = matches.get(prefill.name), matches.get(decode.name)
    dload = kv.replica_load(decode, ctx.identity.key, n_tok)
    pload = kv.replica_load(prefill, ctx.identity.key, n_tok)
    pprof = kv.profile(prefill.name)
    return disagg_cost(
        kv.profile(decode.name),
        n_tok,
        prefill_cached_tokens=(pm.depth if pm else 0) * kv.block_size,
        decode_cached_tokens=(dm.gpu if dm else 0) * kv.block_size,
        decode_batch=dload.decode_batch,
        decode_context_tokens=dload.decode_context_tokens,
        prefill_queue_s=queue_time(pprof, pload.queued_prefill_tokens) or 0.0,
        min_prompt_tokens=min_prompt_tokens,
    )


def _hint(body: Mapping[str, Any]) -> dict[str, Any]:
    """The router's retention hint (``kv_transfer_params.kvroute``, :mod:`router.hints`),
    which both legs keep: the engine plugin on either replica reads it there."""
    params = body.get("kv_transfer_params")
    if isinstance(params, Mapping) and "kvroute" in params:
        return {"kvroute": params["kvroute"]}
    return {}


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body (see the module doc)."""
    out = dict(body)
    out["kv_transfer_params"] = {
        **_hint(body),
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefill leg's ``kv_transfer_params``
    (none: the decode replica prefills the prompt itself — still one correct answer), and
    the router's retention hint when the call carries one."""
    out = dict(body)
    merged = {**dict(params or {}), **_hint(body)}
    if merged:
        out["kv_transfer_params"] = merged
    else:
        out.pop("kv_transfer_params", None)
    return out
