"""Closed-loop lanes over a trace: which session play a lane takes next.

Owns: :class:`PlayCounter`, the one rule the HTTP replay (:mod:`loadtest.replay.runner`) and
the in-process simulator (:mod:`loadtest.sim.trace`) both follow, so a policy compared in the
simulator is compared on the workload the replay sends: at start lane u takes play k = u;
afterwards whichever lane frees first takes the next k from one shared counter; k is session
``k % n`` of play ``k // n``; plays after the first happen only when the run recycles (it has
a time bound); ``max_plays`` bounds the plays handed out. Pure: no clock, no I/O.
"""

from __future__ import annotations


class PlayCounter:
    def __init__(self, n_sessions: int, *, recycle: bool, max_plays: int | None = None):
        self.n_sessions = n_sessions
        self.recycle = recycle
        self.max_plays = max_plays
        self.started = 0  # plays handed out

    def next(self) -> tuple[int, int] | None:
        """``(session index, play)`` for the lane that asks, or ``None``: no more plays."""
        k = self.started
        if self.n_sessions < 1 or (self.max_plays is not None and k >= self.max_plays):
            return None
        play, idx = divmod(k, self.n_sessions)
        if play > 0 and not self.recycle:
            return None
        self.started += 1
        return idx, play
