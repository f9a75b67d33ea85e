"""Responses API ids: which replica produced each response, for the calls that name one.

vLLM keeps a response (for ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
``previous_response_id``) in the memory of the replica that produced it; another replica
answers 404. Owns :class:`ResponseOwners`, a bounded LRU of response id → (replica, session
identity) filled from the answers the proxy relays (:func:`response_id` reads the id from a
JSON answer or from a stream's ``response.created`` event), and :func:`valid_response_id`.
Pure: no I/O, no aiohttp.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from router.sessions import SessionIdentity

RESPONSES_ROUTE = "/v1/responses"
MAX_OWNERS = 65_536  # ids remembered per router process (oldest forgotten first)
# the first "id" of a Responses answer or of its stream's first event is the response's own
# (vLLM: ``{"id": "resp_…", …}``; ``{"response": {"id": "resp_…", …}, …}``)
_ID = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9_.:-]{1,256})"')
_VALID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")


def valid_response_id(rid: str) -> bool:
    """Whether ``rid`` is an id the router may put in an upstream path as it is."""
    return _VALID.fullmatch(rid) is not None


def response_id(head: bytes) -> str | None:
    """The response id in the first bytes of a Responses answer (JSON or SSE), if there."""
    m = _ID.search(head)
    return m.group(1).decode() if m else None


@dataclass(frozen=True, slots=True)
class ResponseOwner:
    replica: str
    tenant: str
    identity: SessionIdentity | None  # the session of the call that produced it, if known


class ResponseOwners:
    """Response id → the replica that produced it and the producing call's session."""

    def __init__(self, cap: int = MAX_OWNERS):
        self.cap = cap
        self._d: OrderedDict[str, ResponseOwner] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def note(
        self, rid: str, replica: str, tenant: str, identity: SessionIdentity | None = None
    ) -> None:
        self._d[rid] = ResponseOwner(replica, tenant, identity)
        self._d.move_to_end(rid)
        while len(self._d) > self.cap:
            self._d.popitem(last=False)

    def note_answer(self, head: bytes, replica: str, identity: SessionIdentity) -> str | None:
        """Remember the id found in ``head`` (an answer's first bytes); returns it."""
        rid = response_id(head)
        if rid is not None:
            self.note(rid, replica, identity.tenant, identity)
        return rid

    def get(self, rid: str) -> ResponseOwner | None:
        owner = self._d.get(rid)
        if owner is not None:
            self._d.move_to_end(rid)
        return owner
