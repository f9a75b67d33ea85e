"""The session footprints by replica, as columns: :class:`FootprintTable`.

Owns: the KV layer's session table (``KVState.sessions``, a ``dict`` of
:class:`router.kv.sessions.SessionFootprint` by session key) kept bucketed by the replica that
holds each session's KV, with each bucket's numbers as numpy columns (context tokens, last end,
mean gap, in-flight counts, ...). A decision prices every replica's paced agents and warm
sessions (:meth:`router.kv.snapshot.StateView.warm_and_reserved`): 10,000 sessions over 64
replicas cost ~40 ms of Python per decision when every footprint was walked on every view
(``bench_decisions``). Here a bucket's columns are rebuilt only when one of its sessions
changed — a footprint tells its table when a field is set, and the table sees sessions added
and removed — so a decision reads each replica's columns and computes P(return) for all of
them at once.

The same figures as the per-session loop, to the last bit of numpy's ``exp`` against
``math.exp`` (random changes checked against that loop in tests/unit/test_kv_footprints.py).
Pure: numpy, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from router.kv.sessions import SessionFootprint

# the columns of one replica's bucket (numpy arrays, one entry per session)
_COLS = ("tokens", "last_end", "gap", "final", "inflight", "children", "turn", "hold")


class Bucket:
    """One replica's sessions with KV (``replica`` set, ``tokens`` > 0), as columns."""

    __slots__ = ("_memo", "keys", "members", "next_tokens", "pinned", "pos", "reservable",
                 *_COLS)  # fmt: skip

    def __init__(self, members: list[SessionFootprint]):
        self.members = members
        self.keys = [s.key for s in members]
        n = len(members)
        self.tokens = np.fromiter((s.tokens for s in members), np.float64, n)
        self.last_end = np.fromiter(
            (np.nan if s.last_end is None else s.last_end for s in members), np.float64, n
        )
        self.gap = np.fromiter(
            (np.nan if (g := s.mean_gap()) is None else g for s in members), np.float64, n
        )
        self.final = np.fromiter((s.final for s in members), bool, n)
        self.inflight = np.fromiter((s.inflight for s in members), np.int64, n)
        self.children = np.fromiter((s.children_inflight for s in members), np.int64, n)
        self.turn = np.fromiter((s.turn_tokens for s in members), np.int64, n)
        self.hold = np.fromiter((s.hold_s for s in members), np.float64, n)
        self.pos = {k: i for i, k in enumerate(self.keys)}
        self.pinned = (self.inflight > 0) | (self.children > 0)  # never evicted
        self.reservable = (self.inflight == 0) & ~self.final  # between calls, not done
        self.next_tokens = np.maximum(self.turn, 1)  # a reservation's next prefill
        self._memo: dict[str, Any] = {}  # per-bucket derived figures (e.g. prefill times)

    def __len__(self) -> int:
        return len(self.members)

    def memo(self, key: str, make: Any) -> Any:
        """``make()`` once per bucket build (the bucket is rebuilt when a member changes)."""
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = make()
        return v


class Picked(Sequence[str]):
    """``keys[idx[i]]`` for each ``i``: a bucket's keys, picked without a copy."""

    __slots__ = ("idx", "keys")

    def __init__(self, keys: list[str], idx: np.ndarray):
        self.keys, self.idx = keys, idx

    def __len__(self) -> int:
        return len(self.idx)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.keys[j] for j in self.idx[i].tolist()]
        return self.keys[int(self.idx[i])]


class FootprintTable(dict[str, SessionFootprint]):
    """``KVState.sessions``: a dict of footprints that keeps :class:`Bucket` s per replica.

    Adding, replacing or removing a footprint, or setting any field of one in the table, marks
    its replica's bucket (and, on a move, the old replica's) for a rebuild on its next read.
    Lists inside a footprint (``gaps``, ``outputs``) must be replaced, not changed in place —
    as the state does — for the table to see it."""

    def __init__(self, items: Iterable[tuple[str, SessionFootprint]] = ()):
        super().__init__()
        self._home: dict[str, str] = {}  # session key -> the replica whose bucket holds it
        self._members: dict[str, dict[str, SessionFootprint]] = {}
        self._buckets: dict[str, Bucket] = {}
        for k, v in items:
            self[k] = v

    # ---- the dict, watched ---------------------------------------------------------------

    def __setitem__(self, key: str, fp: SessionFootprint) -> None:
        old = super().get(key)
        if old is not None and old is not fp:
            old._table = None
            self._place(key, None)
        super().__setitem__(key, fp)
        fp._table = self
        self.changed(fp)

    def __delitem__(self, key: str) -> None:
        fp = super().pop(key)
        fp._table = None
        self._place(key, None)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            fp = super().pop(key)
            fp._table = None
            self._place(key, None)
            return fp
        if default:
            return default[0]
        raise KeyError(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self) -> tuple[str, SessionFootprint]:
        key = next(reversed(self))
        return key, self.pop(key)

    def update(self, *args: Any, **kw: Any) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def clear(self) -> None:
        for fp in self.values():
            fp._table = None
        super().clear()
        self._home.clear()
        self._members.clear()
        self._buckets.clear()

    # ---- buckets -------------------------------------------------------------------------

    def changed(self, fp: SessionFootprint) -> None:
        """``fp`` (in the table) changed: re-bucket it and mark its bucket stale."""
        if super().get(fp.key) is not fp:
            return
        self._place(fp.key, fp.replica if fp.replica is not None and fp.tokens else None, fp)

    def _place(self, key: str, replica: str | None, fp: SessionFootprint | None = None) -> None:
        old = self._home.get(key)
        if old is not None:
            self._buckets.pop(old, None)
            if old != replica:
                m = self._members.get(old)
                if m is not None:
                    m.pop(key, None)
                    if not m:
                        del self._members[old]
                del self._home[key]
        if replica is not None and fp is not None:
            self._members.setdefault(replica, {})[key] = fp
            self._home[key] = replica
            self._buckets.pop(replica, None)

    def bucket(self, replica: str) -> Bucket | None:
        """``replica``'s sessions with KV as columns (None: it holds none)."""
        b = self._buckets.get(replica)
        if b is None:
            m = self._members.get(replica)
            if not m:
                return None
            b = self._buckets[replica] = Bucket(list(m.values()))
        return b

    def by_replica(self) -> Iterator[tuple[str, list[SessionFootprint]]]:
        for r, m in self._members.items():
            yield r, list(m.values())
