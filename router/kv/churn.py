"""How fast each replica's host tier turns over: :class:`TierChurn`, sampled from the block
index's running count of ``BlockRemoved`` (medium CPU) when a view is made. Read by
:meth:`router.kv.snapshot.StateView.host_residence`. Pure: no I/O.
"""

from __future__ import annotations

from collections import deque


class TierChurn:
    """Blocks removed per second from each replica's host tier, over the last ``window_s``:
    samples of the index's running count of ``BlockRemoved`` (medium CPU), one per second
    at most, taken when a view is made (a decision is about to read it)."""

    def __init__(self, window_s: float = 60.0, min_span_s: float = 5.0):
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def sample(self, replica: str, now: float, removed: int) -> None:
        dq = self._samples.get(replica)
        if dq is None:
            dq = self._samples[replica] = deque()
        if dq and removed < dq[-1][1]:
            dq.clear()  # the replica's index state was rebuilt: start over
        if not dq or now - dq[-1][0] >= 1.0:
            dq.append((now, removed))
        while len(dq) > 2 and now - dq[1][0] >= self.window_s:
            dq.popleft()

    def rate(self, replica: str) -> float | None:
        """Removals per second over the window; None until it spans ``min_span_s``."""
        dq = self._samples.get(replica)
        if not dq or dq[-1][0] - dq[0][0] < self.min_span_s:
            return None
        return (dq[-1][1] - dq[0][1]) / (dq[-1][0] - dq[0][0])

    def forget(self, replica: str) -> None:
        self._samples.pop(replica, None)
