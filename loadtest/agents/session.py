"""One agent session through kvroute, checked: turns completed, one replica, exact token counts.

Owns: :func:`agent_session` (an agent CLI's turns through a :class:`loadtest.agents.tap.Tap`
in front of a kvroute, with the router's ``/metrics`` scraped before and after) and
:class:`SessionReport`: per call the route, status, session header, the replica (kvroute's
decision log when given, else the one replica ``/metrics`` counts calls on), prompt and cached
tokens as the client was told, TTFT; and the checks the agents tier asserts —
:meth:`SessionReport.problems` lists what is wrong (empty: all good). Used by the agents test
tier and ``kvroute demo --agent``. Must not import the router package.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtest.agents.clis import Agent, Turn, run_turn
from loadtest.agents.tap import Tap, TapCall

# the headers a router can key a session on, by the client that sends them (docs/agents.md)
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id",
                   "x-session-affinity", "x-parent-session-id", "x-claude-code-agent-id",
                   "x-claude-code-parent-agent-id")  # fmt: skip
IDENTITY_SOURCE = {"claude": "claude-code", "codex": "codex", "opencode": "opencode"}


def scrape(text: str) -> dict[str, Any]:
    """The /metrics figures the checks use: calls per replica (inference routes, status 200),
    prompt and cached tokens (all models), calls per identity source."""
    out: dict[str, Any] = {"by_replica": {}, "prompt": 0.0, "cached": 0.0, "identity": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvroute_requests_total" and s.labels.get("status") == "200":
                r = s.labels.get("replica", "")
                out["by_replica"][r] = out["by_replica"].get(r, 0.0) + s.value
            elif s.name == "kvroute_prompt_tokens_total":
                out["prompt"] += s.value
            elif s.name == "kvroute_prompt_tokens_cached_total":
                out["cached"] += s.value
            elif s.name == "kvroute_identity_calls_total":
                out["identity"][s.labels.get("source", "")] = s.value
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}

    return {"by_replica": sub(after["by_replica"], before["by_replica"]),
            "prompt": after["prompt"] - before["prompt"],
            "cached": after["cached"] - before["cached"],
            "identity": sub(after["identity"], before["identity"])}  # fmt: skip


@dataclass
class CallRow:
    turn: int
    route: str
    status: int
    session_header: str | None
    replica: str | None
    prompt: int | None
    cached: int | None
    output: int | None
    ttft_s: float | None
    stop: str | None
    request_id: str | None


@dataclass
class SessionReport:
    agent: str
    turns: list[Turn]
    calls: list[TapCall]
    metrics: dict[str, Any]  # the run's /metrics delta (see :func:`scrape`)
    decisions: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> line
    call_turn: list[int] = field(default_factory=list)  # per call, the turn it was made in

    @property
    def inference(self) -> list[TapCall]:
        return [c for c in self.calls if c.inference]

    def rows(self) -> list[CallRow]:
        only = list(self.metrics["by_replica"])
        out = []
        for i, c in enumerate(self.calls):
            if not c.inference:
                continue
            d = self.decisions.get(c.request_id or "")
            replica = d.get("winner") if d else (only[0] if len(only) == 1 else None)
            u = c.usage or {}
            sh = next((f"{h}: {c.headers[h]}" for h in SESSION_HEADERS if h in c.headers), None)
            out.append(CallRow(self.call_turn[i] if i < len(self.call_turn) else -1, c.path,
                               c.status, sh, replica, u.get("prompt"), u.get("cached"),
                               u.get("output"), c.ttft_s, c.stop, c.request_id))  # fmt: skip
        return out

    def replicas(self) -> set[str]:
        """The replicas the session's calls landed on: the decision log's winners when there
        is one, else the replicas ``/metrics`` counted answered calls on."""
        if self.decisions:
            return {str(self.decisions[c.request_id]["winner"]) for c in self.inference
                    if c.request_id in self.decisions}  # fmt: skip
        return set(self.metrics["by_replica"])

    def replicas_by_conversation(self) -> dict[str, set[str]]:
        """The replicas each of kvroute's conversations landed on, by its session key in the
        decision log: the agent's own conversation, and one per subagent it spawned (Claude
        Code's Task / Explore agents: kvroute keys a subagent ``<session>#<head>`` and
        places it by its own prefix, which is not its parent's). Without a decision log: the
        whole session as one."""
        if not self.decisions:
            return {"": self.replicas()}
        out: dict[str, set[str]] = {}
        for c in self.inference:
            d = self.decisions.get(c.request_id or "")
            if d:
                out.setdefault(str(d.get("session")), set()).add(str(d["winner"]))
        return out

    def moves(self) -> list[tuple[str, str, str]]:
        """The session's moves in kvroute's decision log: (from, to, reason) per call that
        left the replica holding the session."""
        out = []
        for c in self.inference:
            d = self.decisions.get(c.request_id or "")
            if d and d.get("session_replica") and d["session_replica"] != d.get("winner"):
                out.append((str(d["session_replica"]), str(d["winner"]),
                            str(d.get("move_reason"))))  # fmt: skip
        return out

    def problems(self, *, expect_turns: int, cost_moves: bool = False) -> list[str]:
        """What is wrong with the session; empty when every check holds. ``cost_moves``:
        a move the policy's cost decided (decision log ``move_reason: cost``) is no problem
        (the demo's KV-aware policy; the tier holds every call to one replica)."""
        bad: list[str] = []
        if len(self.turns) < expect_turns:
            bad.append(f"only {len(self.turns)} of {expect_turns} turns ran")
        for t in self.turns:
            if t.rc != 0 or not t.ok:
                bad.append(f"turn {t.index}: exit {t.rc}, not completed: {t.why[:800]}")
        sessions = {t.session for t in self.turns}
        if len(sessions) != 1 or None in sessions:
            bad.append(f"the turns are not one CLI session: {sessions}")
        calls = self.inference
        if not calls:
            bad.append("no inference call reached kvroute")
        failed = [(c.path, c.status) for c in calls if c.status != 200]
        if failed:
            bad.append(f"calls answered with an error: {failed}")
        harmless = {("HEAD", "/"), ("GET", "/"), ("GET", "/v1/models")}
        other = [(c.method, c.path) for c in self.calls
                 if not c.inference and (c.method, c.path) not in harmless]  # fmt: skip
        if other:
            bad.append(f"calls on other paths: {other}")
        heads = {c.headers.get(h) for c in calls for h in SESSION_HEADERS[:4] if h in c.headers}
        if len(heads) != 1:
            bad.append(f"the calls carry {len(heads)} session ids: {heads}")
        justified = cost_moves and self.moves() and all(r == "cost" for *_, r in self.moves())
        for conv, reps in self.replicas_by_conversation().items():
            if len(reps) != 1 and not justified:
                bad.append(f"the calls of conversation {conv!r} landed on {len(reps)} "
                           f"replicas: {sorted(reps)}")  # fmt: skip
        n_ok = sum(1 for c in calls if c.status == 200)
        counted = sum(self.metrics["by_replica"].values())
        if counted != n_ok:
            bad.append(f"/metrics counts {counted:g} answered calls, the client made {n_ok}")
        src = IDENTITY_SOURCE.get(self.agent)
        if src and self.metrics["identity"].get(src, 0) != len(calls):
            bad.append(f"kvroute_identity_calls_total{{source={src!r}}} is "
                       f"{self.metrics['identity'].get(src, 0):g}, calls {len(calls)}: "
                       f"{self.metrics['identity']}")  # fmt: skip
        missing = [c.path for c in calls if c.status == 200 and c.usage is None]
        if missing:
            bad.append(f"answers without usage: {missing}")
        prompt = sum((c.usage or {}).get("prompt", 0) for c in calls)
        cached = sum((c.usage or {}).get("cached", 0) for c in calls)
        if self.metrics["prompt"] != prompt:
            bad.append(f"kvroute_prompt_tokens_total grew {self.metrics['prompt']:g}, the "
                       f"replies' usage says {prompt}")  # fmt: skip
        if self.metrics["cached"] != cached:
            bad.append(f"kvroute_prompt_tokens_cached_total grew {self.metrics['cached']:g}, "
                       f"the replies' usage says {cached}")  # fmt: skip
        return bad


def read_decisions(path: Path | None) -> dict[str, dict[str, Any]]:
    """kvroute's decision log (``--decision-log``) by request id."""
    if path is None or not path.exists():
        return {}
    out = {}
    for line in path.read_bytes().splitlines():
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(d, dict) and d.get("request_id"):
            out[str(d["request_id"])] = d
    return out


async def agent_session(
    agent_cls: type[Agent],
    bin_dir: Path,
    home: Path,
    router_url: str,
    prompts: Iterable[str],
    *,
    decision_log: Path | None = None,
    max_output_tokens: int | None = None,
    timeout_s: float = 300.0,
) -> SessionReport:
    """Run the agent's turns through a tap in front of ``router_url`` and report."""
    prompts = list(prompts)
    async with httpx.AsyncClient(timeout=30) as http, Tap(router_url) as tap:
        before = scrape((await http.get(router_url + "/metrics")).text)
        agent = agent_cls(bin_dir, home, tap.url, max_output_tokens=max_output_tokens)
        call_turn: list[int] = []
        turns: list[Turn] = []

        agent.prepare()
        session = None
        for i, p in enumerate(prompts):
            n0 = len(tap.calls)
            t = await run_turn(agent, i, p, session, timeout_s)
            call_turn += [i] * (len(tap.calls) - n0)
            turns.append(t)
            if not t.ok:
                break
            session = session or t.session
        after = scrape((await http.get(router_url + "/metrics")).text)
    return SessionReport(agent_cls.name, turns, list(tap.calls), _delta(after, before),
                         read_decisions(decision_log), call_turn)  # fmt: skip


def format_rows(rows: list[CallRow]) -> list[list[str]]:
    """Table cells per call: turn, route, replica, prompt, cached, TTFT, stop."""

    def n(v: int | None) -> str:
        return "-" if v is None else f"{v:,}"

    return [[str(r.turn + 1), r.route, r.replica or "?", n(r.prompt), n(r.cached),
             "-" if r.ttft_s is None else f"{r.ttft_s * 1000:.0f} ms", r.stop or "-"]
            for r in rows]  # fmt: skip
