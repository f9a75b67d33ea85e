"""Header hygiene of a proxied call, both ways.

Owns: what never goes upstream — hop-by-hop headers (and any the ``Connection`` header names),
the client's cookies and admin key, ``Content-Encoding`` (the body goes upstream decoded) and
``Expect``; the client's ``Authorization`` / ``x-api-key`` when the router authenticates or
holds an upstream key (which it then sends as ``Authorization``); ``X-Request-Id`` propagated
or assigned — and what never comes back (hop-by-hop). Pure functions of header maps.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# Never forwarded: the client's cookies and admin key are the router's business, and the body
# goes upstream decoded (the HTTP parser undid any gzip/deflate), so its old label goes too.
# ``Expect``: the router has read the whole body already, so no replica is asked to continue.
CLIENT_ONLY = frozenset({"cookie", "x-admin-key", "content-encoding", "expect"})


# the per-call drop sets, built once (a ``Connection`` header naming more adds to them)
_UPSTREAM_DROP = HOP_BY_HOP | CLIENT_ONLY | {"x-request-id"}
_UPSTREAM_DROP_AUTH = _UPSTREAM_DROP | {"authorization", "x-api-key"}
_RESPONSE_DROP = (HOP_BY_HOP - {"content-length"}) | {"x-request-id"}


def _drop(headers: Mapping[str, str], base: frozenset[str] = HOP_BY_HOP) -> frozenset[str]:
    """``base`` (hop-by-hop names), plus any the ``Connection`` header lists."""
    conn = headers.get("connection")
    if not conn:
        return base
    return base | {h.strip().lower() for h in conn.split(",") if h.strip()}


def upstream_headers(
    headers: CIMultiDictProxy[str], rid: str, upstream_key: str | None, strip_auth: bool
) -> CIMultiDict[str]:
    drop = _drop(headers, _UPSTREAM_DROP_AUTH if strip_auth or upstream_key else _UPSTREAM_DROP)
    out = CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])
    out["X-Request-Id"] = rid
    if upstream_key:
        out["Authorization"] = f"Bearer {upstream_key}"
    return out


def response_headers(headers: CIMultiDictProxy[str], rid: str) -> CIMultiDict[str]:
    drop = _drop(headers, _RESPONSE_DROP)
    out = CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in drop])
    out["X-Request-Id"] = rid
    return out
