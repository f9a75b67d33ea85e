"""The bed's teardown kills whole process trees: on exit, on error and on Ctrl-C.

Uses the bed's own process management with a stand-in server (a Python process that forks a
grandchild, as vLLM's API server forks its engine core) so it runs in seconds; the vllm tier's
session fixture additionally asserts that no real replica process is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from loadtest.vllmbed import (
    BED_ENV,
    BedError,
    ManagedProcess,
    ReplicaConfig,
    VllmBed,
    VllmReplica,
    processes_with_marker,
    start_beds,
)

TREE = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stubborn server: only SIGKILL works
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)                              # the "engine core" grandchild
    time.sleep(600)
""")


def _wait_gone(bed_id: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_with_marker(bed_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _start_tree(tmp_path: Path) -> tuple[str, ManagedProcess]:
    bed_id = uuid.uuid4().hex
    env = {**os.environ, BED_ENV: bed_id}
    p = ManagedProcess([sys.executable, "-c", TREE], env, tmp_path / "log", tmp_path)
    p.start()
    deadline = time.monotonic() + 10
    while len(processes_with_marker(bed_id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert len(processes_with_marker(bed_id)) == 3  # reaper, server, grandchild
    except AssertionError:
        p.stop(grace_s=0.5)  # never leave the tree behind, even when this check fails
        raise
    return bed_id, p


def test_stop_kills_stubborn_process_tree(tmp_path):
    bed_id, p = _start_tree(tmp_path)
    p.stop(grace_s=0.5)
    assert _wait_gone(bed_id) == []


def _autogroup(pid: int | str) -> str:
    """The task's autogroup ("/autogroup-4145"), or "": the file reads empty for a task left in
    the kernel's default autogroup (as on the project's CI machine), and then its children
    started in the caller's session are there too."""
    text = Path(f"/proc/{pid}/autogroup").read_text().split()
    return text[0] if text else ""


def test_the_tree_is_a_process_group_of_its_own_in_the_callers_session(tmp_path):
    """Its own group, so a stop reaches the whole tree and nothing else; the caller's
    session, because with the kernel's autogroup a new session is a scheduling group as
    strong as the caller's whole session (docs/engine.md, "Bursts on the vLLM-CPU test
    bed")."""
    bed_id, p = _start_tree(tmp_path)
    try:
        tree = processes_with_marker(bed_id)
        assert {os.getsid(pid) for pid in tree} == {os.getsid(0)}
        assert {os.getpgid(pid) for pid in tree} == {p.proc.pid} != {os.getpgid(0)}
        if Path("/proc/self/autogroup").exists():  # a kernel built with autogroup: the caller's
            assert {_autogroup(pid) for pid in tree} == {_autogroup("self")}
    finally:
        p.stop(grace_s=0.5)
    assert _wait_gone(bed_id) == []


OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from loadtest.vllmbed import ManagedProcess, BED_ENV
    import os
    tree = sys.argv[1]; d = Path(sys.argv[2])
    p = ManagedProcess([sys.executable, "-c", tree], dict(os.environ), d / "log", d)
    p.start()
    try:
        print("started", flush=True)
        time.sleep(600)
    finally:
        p.stop(grace_s=0.5)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_owner_interrupted_or_killed_leaves_nothing(tmp_path, sig):
    # Ctrl-C runs the owner's teardown; SIGKILL skips it, and the reaper must still take
    # the whole group down, grandchild included.
    bed_id = uuid.uuid4().hex
    env = {**os.environ, BED_ENV: bed_id, "PYTHONPATH": str(Path(__file__).parents[2])}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, TREE, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None and owner.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 10
    while len(processes_with_marker(bed_id)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(processes_with_marker(bed_id)) == 4  # owner, reaper, server, grandchild
    owner.send_signal(sig)
    owner.wait(timeout=10)
    assert _wait_gone(bed_id) == []


HEALTH = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _replica(tmp_path: Path, argv: list[str] | None = None) -> VllmReplica:
    """A bed replica whose process is a stand-in (a /health server on its port, or ``argv``)."""
    r = VllmReplica(ReplicaConfig("stand-in", tmp_path), uuid.uuid4().hex, tmp_path,
                    Path(sys.executable))  # fmt: skip
    r.argv = argv or [sys.executable, "-c", HEALTH, str(r.cfg.port)]
    r.env = {**os.environ, BED_ENV: r.bed_id}
    return r


def test_ready_means_the_replica_itself_answers_on_its_port(tmp_path):
    r = _replica(tmp_path)
    r.start()
    try:
        r.wait_ready(time.monotonic() + 10)  # its own /health, on a socket it holds
        assert r.holds_port()
    finally:
        r.stop(grace_s=0.5)


def test_another_server_on_the_replicas_port_is_refused_not_taken_for_it(tmp_path):
    """The port is picked free and released before vLLM binds it: a server that binds it
    meanwhile answers /health for the replica (the likely cause of one failure of the tiers
    fidelity test: its "real" replica answered as the twin does and published no events). The
    bed refuses that instead of reporting ready."""
    r = _replica(tmp_path, [sys.executable, "-c", "import time; time.sleep(600)"])
    # the squatter: the same /health stand-in, in a process outside the bed
    squatter = subprocess.Popen([sys.executable, "-c", HEALTH, str(r.cfg.port)])
    try:
        deadline = time.monotonic() + 10
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", r.cfg.port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the squatter never listened"
                time.sleep(0.05)
        r.start()
        try:
            assert not r.holds_port()
            with pytest.raises(BedError, match="served by another process"):
                r.wait_ready(time.monotonic() + 10)
        finally:
            r.stop(grace_s=0.5)
    finally:
        squatter.kill()
        squatter.wait()


def _stand_in_bed(tmp_path: Path, name: str, argv: list[str] | None = None) -> VllmBed:
    bed = VllmBed([ReplicaConfig(name, tmp_path)], python=Path(sys.executable),
                  workdir=tmp_path / name, start_timeout_s=20)  # fmt: skip
    for r in bed:
        r.argv = argv or [sys.executable, "-c", HEALTH, str(r.cfg.port)]
        r.env = {**os.environ, BED_ENV: bed.bed_id}
    return bed


def test_beds_started_together_are_all_stopped_when_one_fails(tmp_path):
    """start_beds launches every bed's replicas at once; one that dies at start fails the lot,
    and no process of any of them is left."""
    ok = _stand_in_bed(tmp_path, "ok")
    dead = _stand_in_bed(tmp_path, "dead", [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(BedError, match="exited"):
        start_beds([ok, dead])
    assert _wait_gone(ok.bed_id) == [] and _wait_gone(dead.bed_id) == []


def test_beds_started_together_are_ready_together(tmp_path):
    beds = [_stand_in_bed(tmp_path, f"r{i}") for i in range(3)]
    try:
        start_beds(beds)
        assert all(r.alive() and r.holds_port() for b in beds for r in b)
    finally:
        for b in beds:
            b.stop()
    assert all(_wait_gone(b.bed_id) == [] for b in beds)
