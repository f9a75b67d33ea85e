"""Processes a sweep point needs: a twin cluster and a router in front of it.

Owns: :class:`TwinCluster` (``kvroute cluster`` as a child process: replicas' URLs are read
from its stdout) and :class:`Router` (one of :data:`ROUTERS`: kvroute with a policy, or a
peer router from its own venv), each started, health-checked and stopped by process group
under :mod:`loadtest.reaper` (children die with the harness). Everything listens on
127.0.0.1, on free ports. Separate processes keep the client's clock off the cluster's and
the router's CPU. Must not import the router package (routers are driven over HTTP).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.vllmbed import BED_ENV, ManagedProcess, free_port


class StackError(RuntimeError):
    pass


def _kvroute_argv() -> list[str]:
    return [sys.executable, "-m", "kvroute.cli"]


def _wait_http(proc: ManagedProcess, url: str, deadline: float, what: str) -> None:
    with httpx.Client(timeout=2.0) as c:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise StackError(f"{what} exited:\n{proc.log_tail()}")
            try:
                if c.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise StackError(f"{what} not healthy at {url} in time:\n{proc.log_tail()}")


@dataclass
class TwinCluster:
    replicas: int = 4
    profile: str = "h200-70b-fp8"
    speedup: float = 10.0
    kv_events: str | None = None
    truth: str | None = None  # the engines' timing (loadtest.twin.truth); None: the CLI's default
    # profile overrides (``kvroute cluster --set KEY=VALUE``), e.g. "pool_kv_blocks=N"
    overrides: list[str] = field(default_factory=list)
    roles: list[str] | None = None  # P/D role per twin (``kvroute cluster --roles``)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvroute-sw-")))
    urls: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    event_endpoints: dict[str, str] = field(default_factory=dict)  # url -> bound ZMQ endpoint
    _proc: ManagedProcess | None = None

    def start(self, timeout_s: float = 60.0) -> TwinCluster:
        argv = [
            *_kvroute_argv(),
            "cluster",
            "--replicas",
            str(self.replicas),
            "--profile",
            self.profile,
            "--speedup",
            repr(self.speedup),
            "--enable-auto-tool-choice",  # agents send tools with tool_choice "auto"
        ]
        if self.kv_events:
            argv += ["--kv-events", self.kv_events]
            if "*" in self.kv_events:
                # one endpoint per twin names the twin: publish on vLLM's default topic, the
                # empty one (vllm-router's static sources take nothing else; kv@<name> made
                # its kv_aware credit no prefix at all)
                argv += ["--kv-events-topic", ""]
        if self.truth:
            argv += ["--truth", self.truth]
        for kv in self.overrides:
            argv += ["--set", kv]
        if self.roles:
            argv += ["--roles", ",".join(self.roles)]
        env = {**os.environ, BED_ENV: f"sweep-{uuid.uuid4().hex[:8]}", "PYTHONUNBUFFERED": "1"}
        log = self.workdir / f"cluster-{uuid.uuid4().hex[:6]}.log"
        self._proc = ManagedProcess(argv, env, log, Path.cwd())
        self._proc.start()
        try:
            self._wait_ready(log, timeout_s)
        except BaseException:  # never leave a half-started cluster process behind
            self.stop()
            raise
        return self

    def _wait_ready(self, log: Path, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(self.urls) < self.replicas:
            if not self._proc.alive():
                raise StackError(f"twin cluster exited:\n{self._proc.log_tail()}")
            lines = [x.split() for x in log.read_text(errors="replace").splitlines()]
            pairs = [x for x in lines if len(x) == 2 and x[1].startswith("http://")]
            self.names, self.urls = [p[0] for p in pairs], [p[1] for p in pairs]
            bound = {x[1]: x[3] for x in lines if len(x) >= 4 and x[0] == "kv-events"}
            if self.kv_events and "*" in self.kv_events and len(bound) < self.replicas:
                self.urls = []  # wait for every replica's bound endpoint
            else:
                self.event_endpoints = {
                    u: bound[n] for n, u in zip(self.names, self.urls, strict=True) if n in bound
                }
            time.sleep(0.05)
        if len(self.urls) < self.replicas:
            raise StackError(f"twin cluster did not report {self.replicas} replicas")
        for u in self.urls:
            _wait_http(self._proc, u + "/health", deadline, "twin cluster")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=5.0)
            self._proc = None
        self.urls, self.names = [], []

    @property
    def pgid(self) -> int | None:
        """The cluster's process group (its reaper's pid), for :mod:`loadtest.sweep.cpuwatch`."""
        return self._proc.proc.pid if self._proc is not None and self._proc.proc else None

    @property
    def metrics_urls(self) -> list[str]:
        return [u + "/metrics" for u in self.urls]

    def __enter__(self) -> TwinCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Peer routers as installed by ``make bench-peers`` (versions in scripts/setup_peers.sh):
# name -> (kind, policy, session convention its policy keys on). sglang-router 0.3.2 offers
# random, round_robin, cache_aware, power_of_two, manual (no consistent_hashing: that is in
# the later sgl-model-gateway); vllm-router 0.1.17's consistent_hash keys on x-session-id
# (the OpenCode convention). vllm-router's kv_aware needs one ZMQ publisher endpoint per
# worker that it can connect to (``--kv-event-source URL=ENDPOINT``): the bench starts the
# twins with ``--kv-events tcp://127.0.0.1:*`` (each twin binds its own loopback port) for it.
# ``dynamo:kv`` is NVIDIA Dynamo's KV router (``ai-dynamo-runtime`` 1.6.1's SelectionService)
# behind the harness's HTTP front (:mod:`loadtest.sweep.dynamo_front`), fed by the same
# per-twin event endpoints, with Dynamo's defaults (no session affinity);
# ``dynamo:kv_affinity`` adds its session affinity (an idle TTL of an hour) keyed on
# ``X-Dynamo-Session-ID``, the header its frontend reads (the ``dynamo`` convention).
PEERS: dict[str, tuple[str, str, str]] = {
    "sglang:cache_aware": ("sglang", "cache_aware", "claude"),
    "sglang:round_robin": ("sglang", "round_robin", "claude"),
    "vllm-router:cache_aware": ("vllm-router", "cache_aware", "opencode"),
    "vllm-router:consistent_hash": ("vllm-router", "consistent_hash", "opencode"),
    "vllm-router:round_robin": ("vllm-router", "round_robin", "opencode"),
    "vllm-router:kv_aware": ("vllm-router", "kv_aware", "opencode"),
    "dynamo:kv": ("dynamo", "kv", "dynamo"),
    "dynamo:kv_affinity": ("dynamo", "kv_affinity", "dynamo"),
}
DYNAMO_AFFINITY_TTL_S = 3600.0
# kvroute policies that use its KV layer (block index fed by the twins' events, tokenizer).
KV_POLICIES = {"kv_cost", "llmd", "sglang_tree"}


def pd_capable(name: str) -> str | None:
    """Why ``name`` cannot route a P/D set (``--pd``), or None when it can: kvroute (roles
    in ``URL#role=``) and vllm-router's P/D mode (``--vllm-pd-disaggregation --prefill URL
    --decode URL``, vLLM's ``kv_transfer_params`` legs, which the twins answer). Its
    ``kv_aware`` prefill policy reads ``--pd-kv-events`` at a fixed block size of 16, which
    no twin profile has; sglang-router's P/D mode speaks SGLang's bootstrap protocol and
    Dynamo's front has no P/D path."""
    if name.startswith("kvroute:"):
        return None
    if name == "vllm-router:kv_aware":
        return "vllm-router's kv_aware P/D prefill policy takes events at block size 16 only"
    if name.startswith("vllm-router:") and name in PEERS:
        return None
    return "its P/D mode is not wired (kvroute and vllm-router only)"


def needs_events(name: str) -> bool:
    """Whether a router is fed by the twins' KV events (one bound endpoint per twin)."""
    if name.startswith("kvroute:"):
        return name.split(":", 1)[1] in KV_POLICIES
    return name == "vllm-router:kv_aware" or name.startswith("dynamo:")


def peer_health_args(name: str, interval_s: int | None) -> list[str]:
    """The flags that make peer ``name`` check each replica's ``/health`` every ``interval_s``
    wall seconds and take it out at the first failed check, as kvroute does (its defaults:
    every 2 s, a non-2xx answer once). ``None``, kvroute targets and Dynamo's front (no
    health checks): none. At their defaults sglang-router and vllm-router check every 60 s
    and need 3 failures, so a replica drained for a rolling restart is never taken out."""
    if interval_s is None or name not in PEERS or PEERS[name][0] == "dynamo":
        return []
    if interval_s < 1:
        raise StackError("a peer's health-check interval is whole seconds, at least 1")
    return ["--health-check-interval-secs", str(int(interval_s)), "--health-failure-threshold", "1"]


def peer_python(kind: str) -> Path | None:
    """The peer's venv interpreter (``make bench-peers``), or None when not installed."""
    cache = Path(os.environ.get("KVROUTE_CACHE", Path.home() / ".cache" / "kvroute"))
    for d in sorted(cache.glob(f"peers-{'sglang-router' if kind == 'sglang' else kind}-*")):
        if (d / ".ready").exists():
            return d / "bin" / "python"
    return None


@dataclass
class Router:
    """A router in front of ``replicas``: ``kvroute:<policy>`` or one of :data:`PEERS`."""

    name: str
    replicas: Sequence[str]
    workdir: Path
    event_endpoints: dict[str, str] = field(default_factory=dict)  # replica url -> endpoint
    block_size: int = 64
    model: str = "tiny"
    # the profile kvroute's KV layer prices with (never the twins' truth); "none": no profile
    profile: str = "h200-70b-fp8"
    model_dir: str | None = None  # the twins' tokenizer folder (kvroute's KV layer)
    speedup: float = 1.0  # the twins' --speedup (kvroute's KV layer calibrates in profile time)
    port: int = 0
    extra_args: list[str] = field(default_factory=list)  # appended to the router's argv
    # added to the router's environment; KVROUTE_KV_* here replace what kv_env derives
    extra_env: dict[str, str] = field(default_factory=dict)
    # P/D role per replica URL (kvroute: ``--replica URL#role=...``; vllm-router: its P/D
    # mode's ``--prefill URL`` / ``--decode URL``; see :func:`pd_capable`)
    roles: dict[str, str] = field(default_factory=dict)
    _proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> tuple[list[str], str]:
        """(argv, health path) for this router."""
        self.port = self.port or free_port()
        if self.name.startswith("kvroute:"):
            policy = self.name.split(":", 1)[1]
            argv = [
                *_kvroute_argv(),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                policy,
                "--log-level",
                "WARNING",
            ]
            for r in self.replicas:
                role = self.roles.get(r)
                argv += ["--replica", f"{r}#role={role}" if role else r]
            return argv, "/ready"
        if self.name not in PEERS:
            raise StackError(f"unknown router {self.name!r}: kvroute:<policy> or {sorted(PEERS)}")
        if self.roles and (why := pd_capable(self.name)) is not None:
            raise StackError(f"{self.name} cannot run P/D (--pd): {why}")
        kind, policy, _ = PEERS[self.name]
        py = peer_python(kind)
        if py is None:
            raise StackError(f"{self.name}: peer not installed (run `make bench-peers`)")
        if kind == "dynamo":
            return self._dynamo_argv(py, policy), "/health"
        module = "sglang_router.launch_router" if kind == "sglang" else "vllm_router.launch_router"
        # both peers bind a Prometheus exporter on 29000 by default: a second instance (or the
        # other peer still stopping) panics with "Address already in use"; give each its own
        argv = [str(py), "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--policy", policy]  # fmt: skip
        if self.roles:  # vllm-router's P/D mode: --policy for both stages, NIXL's protocol
            argv.append("--vllm-pd-disaggregation")
            for r in self.replicas:
                role = self.roles.get(r, "both")
                if role == "both":
                    raise StackError(f"{self.name}: P/D mode takes prefill or decode roles only")
                argv += [f"--{role}", r]
            return argv, "/health"
        argv += ["--worker-urls", *self.replicas]
        if needs_events(self.name):
            if not self.event_endpoints:
                raise StackError(f"{self.name} needs the twins' KV event endpoints")
            argv += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
            for url, ep in self.event_endpoints.items():
                argv += ["--kv-event-source", f"{url}={ep}"]
        return argv, "/health"

    def _dynamo_argv(self, py: Path, policy: str) -> list[str]:
        """The harness's front over Dynamo's SelectionService, run by the Dynamo venv."""
        from loadtest import tinymodel

        if not self.event_endpoints:
            raise StackError(f"{self.name} needs the twins' KV event endpoints")
        argv = [str(py), "-m", "loadtest.sweep.dynamo_front", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", self.model,
                "--block-size", str(self.block_size),
                "--tokenizer", str(self.model_dir or tinymodel.ensure())]  # fmt: skip
        missing = [u for u in self.replicas if u not in self.event_endpoints]
        if missing:
            raise StackError(f"{self.name}: no KV event endpoint for {missing}")
        for url in self.replicas:
            argv += ["--worker", f"{url}={self.event_endpoints[url]}"]
        if policy == "kv_affinity":
            argv += ["--session-affinity-ttl-secs", repr(DYNAMO_AFFINITY_TTL_S)]
        return argv

    def peer_env(self) -> dict[str, str]:
        """The Dynamo front imports the twins' tokenizer from this checkout; Dynamo's own
        logs at warn (its INFO line per selection costs the front's CPU)."""
        if not self.name.startswith("dynamo:"):
            return {}
        root = str(Path(__file__).resolve().parents[2])
        pp = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": root + (os.pathsep + pp if pp else ""),
                "DYN_LOG": os.environ.get("DYN_LOG", "warn")}  # fmt: skip

    def kv_env(self) -> dict[str, str]:
        """``KVROUTE_KV_*`` for kvroute's KV layer: tokenizer, blocks, profile, event sources."""
        if not (self.name.startswith("kvroute:") and needs_events(self.name)):
            return {}
        if any(k.startswith("KVROUTE_KV_") for k in self.extra_env):
            return {}  # the caller wires the KV layer itself (e.g. bound events, real vLLM)
        if not self.event_endpoints:
            raise StackError(f"{self.name} needs the twins' KV event endpoints")
        import json

        from loadtest import tinymodel

        return {
            "KVROUTE_KV_TOKENIZER": str(self.model_dir or tinymodel.ensure()),
            "KVROUTE_KV_BLOCK_SIZE": str(self.block_size),
            "KVROUTE_KV_PROFILE": self.profile,
            "KVROUTE_KV_EVENTS_CONNECT": json.dumps(self.event_endpoints),
            "KVROUTE_KV_TIME_SCALE": repr(self.speedup),  # calibrate in profile seconds
        }

    def start(self, timeout_s: float = 60.0) -> Router:
        argv, health = self.argv()
        argv += self.extra_args
        env = {**os.environ, BED_ENV: f"sweep-{uuid.uuid4().hex[:8]}", "PYTHONUNBUFFERED": "1"}
        env.update(self.kv_env())
        env.update(self.peer_env())
        env.update(self.extra_env)
        log = self.workdir / f"router-{self.name.replace(':', '-')}-{self.port}.log"
        self._proc = ManagedProcess(argv, env, log, Path.cwd())
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        try:
            _wait_http(self._proc, self.url + health, deadline, self.name)
            if self.name.startswith("sglang:"):
                self._wait_sglang_workers(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pgid(self) -> int | None:
        """The router's process group (its reaper's pid), for :mod:`loadtest.sweep.cpuwatch`."""
        return self._proc.proc.pid if self._proc is not None and self._proc.proc else None

    def _wait_sglang_workers(self, deadline: float) -> None:
        """sglang-router answers /health once its *first* worker has registered (0.3.2: the
        workers register concurrently): wait until /workers lists every one, healthy."""
        assert self._proc is not None
        ws: list[dict] = []
        with httpx.Client(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if not self._proc.alive():
                    raise StackError(f"{self.name} exited:\n{self._proc.log_tail()}")
                try:
                    ws = c.get(self.url + "/workers").json().get("workers", [])
                except (httpx.HTTPError, ValueError):
                    ws = []
                if len(ws) >= len(self.replicas) and all(w.get("is_healthy") for w in ws):
                    return
                time.sleep(0.05)
        raise StackError(f"{self.name} lists {len(ws)} of {len(self.replicas)} workers in time")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop(grace_s=5.0)
            self._proc = None

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cleanup(workdir: Path) -> None:
    if os.environ.get("KVROUTE_KEEP_BED_LOGS") != "1":
        shutil.rmtree(workdir, ignore_errors=True)
