"""router.headers: what goes upstream of a client's headers, and what comes back."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from router.headers import response_headers, upstream_headers


def _h(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_upstream_drops_hop_by_hop_client_only_and_connection_named_headers():
    client = _h(
        ("Host", "router"), ("Connection", "keep-alive, X-Trace"), ("X-Trace", "t"),
        ("Cookie", "c=1"), ("X-Admin-Key", "adm"), ("Content-Encoding", "gzip"),
        ("Expect", "100-continue"), ("X-Request-Id", "theirs"), ("Authorization", "Bearer ck"),
        ("Accept", "text/event-stream"), ("X-Session-Id", "s1"),
    )  # fmt: skip
    out = upstream_headers(client, "rid-1", None, strip_auth=False)
    assert dict(out) == {
        "Authorization": "Bearer ck",  # no router auth, no upstream key: the client's own
        "Accept": "text/event-stream",
        "X-Session-Id": "s1",
        "X-Request-Id": "rid-1",
    }


def test_the_upstream_key_replaces_the_clients_credentials():
    client = _h(("Authorization", "Bearer client"), ("x-api-key", "client"), ("Accept", "*/*"))
    out = upstream_headers(client, "r", "sk-up", strip_auth=False)
    assert out.getall("Authorization") == ["Bearer sk-up"] and "x-api-key" not in out
    # the router authenticates clients: their keys are its business, never the replica's
    out = upstream_headers(client, "r", None, strip_auth=True)
    assert "Authorization" not in out and "x-api-key" not in out and out["Accept"] == "*/*"


def test_response_keeps_its_length_and_gets_the_request_id():
    replica = _h(("Content-Length", "2"), ("Transfer-Encoding", "chunked"),
                 ("X-Request-Id", "replica's"), ("Content-Type", "application/json"))  # fmt: skip
    out = response_headers(replica, "rid-2")
    assert dict(out) == {
        "Content-Length": "2", "Content-Type": "application/json", "X-Request-Id": "rid-2",
    }  # fmt: skip
