"""A stand-in for the processes ``kvroute bench`` starts (tests of what a sweep point would
start, with no process started)."""

from __future__ import annotations

from typing import Any

STOPPED = "stopped by the test"


def fake_sweep_processes(monkeypatch: Any) -> list[tuple[list[str], dict[str, str]]]:
    """Fake :class:`loadtest.sweep.stack.ManagedProcess` and the twin cluster's readiness:
    every process the sweep builds is recorded as ``(argv, env)`` in the list returned; the
    twin cluster "starts" ready with two twins, and the first other process (the router or a
    peer) raises ``StackError(STOPPED)``, which ends the point there."""
    from loadtest.sweep import stack

    started: list[tuple[list[str], dict[str, str]]] = []

    class FakeProcess:
        def __init__(self, argv, env, log, cwd):
            self.argv, self.env, self.proc = list(argv), env, None
            started.append((self.argv, env))

        def start(self):
            if "cluster" not in self.argv:  # the router or a peer: seen, now stop the point
                raise stack.StackError(STOPPED)

        def alive(self):
            return True

        def stop(self, grace_s=5.0):
            pass

    def ready(self, log, timeout_s):
        self.names, self.urls = ["twin-0", "twin-1"], ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        self.event_endpoints = {u: f"tcp://127.0.0.1:{9 + i}" for i, u in enumerate(self.urls)}

    monkeypatch.setattr(stack, "ManagedProcess", FakeProcess)
    monkeypatch.setattr(stack.TwinCluster, "_wait_ready", ready)
    return started
