"""The three agent CLIs, driven non-interactively against kvroute: configuration, turns, results.

Owns: :class:`Agent` and its three kinds — :class:`ClaudeCode` (Anthropic Messages,
``claude -p``, turn 2 ``--resume <session>``), :class:`Codex` (OpenAI Responses, ``codex
exec``, turn 2 ``codex exec resume <thread>``) and :class:`OpenCode` (chat completions
through the AI SDK's openai-compatible provider, ``opencode run``, turn 2 ``--session <id>``)
— each with a private home (config files, sessions; nothing read from the user's own), an
environment built from nothing (the CLI's base URL at kvroute, a dummy key, every
phone-home switch off), and a reader of its machine output that says whether the turn
completed. :func:`run_turn` runs one turn as a child process (asyncio: the router and the tap
may share the caller's event loop). docs/agents.md says the same for people.

Must not import the router package.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

DUMMY_KEY = "sk-kvroute-local"  # kvroute without --api-key accepts any key
OFFLINE_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a connect fails
# a tiny project for the agent to look at (its working folder)
PROJECT = {
    "README.md": "# notes\n\nA small project: `hello.py` prints a greeting.\n",
    "hello.py": 'def greet(name):\n    return f"hello {name}"\n\n\nprint(greet("kvroute"))\n',
}


@dataclass
class Turn:
    """One turn of an agent: its process and what its machine output says."""

    agent: str
    index: int
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    elapsed_s: float
    ok: bool = False  # the CLI says the turn completed
    text: str = ""  # the agent's final answer
    session: str | None = None  # the CLI's own session / thread id
    why: str = ""  # why the turn is not ok (or ""), from the CLI's output
    result: dict[str, Any] = field(default_factory=dict)  # the CLI's result object, if any


class Agent:
    """One CLI. Subclasses fill the class attributes and the three methods."""

    name: ClassVar[str]
    binary: ClassVar[str]
    package: ClassVar[str]  # the npm package (loadtest/agents/versions.txt)
    api: ClassVar[str]  # the route it calls

    def __init__(self, bin_dir: Path, home: Path, base_url: str, model: str = "tiny",
                 max_output_tokens: int | None = None):  # fmt: skip
        self.bin = bin_dir / self.binary
        self.home = home
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_output_tokens = max_output_tokens
        self.workdir = home / "project"

    def prepare(self) -> None:
        """Write the private home's config and the project folder."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name, text in PROJECT.items():
            (self.workdir / name).write_text(text)

    def env(self) -> dict[str, str]:
        """An environment from nothing: none of the user's keys, configs or proxies."""
        node = shutil.which("node")
        path = os.pathsep.join(dict.fromkeys(
            [str(self.bin.parent), *([str(Path(node).parent)] if node else []), "/usr/bin",
             "/bin"]))  # fmt: skip
        return {
            "PATH": path,
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_DATA_HOME": str(self.home / ".local/share"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_STATE_HOME": str(self.home / ".local/state"),
            "TMPDIR": str(self.home / "tmp"),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "CI": "1",
            "DO_NOT_TRACK": "1",
            # what a CLI still tries to fetch on its own (Codex looks up api.github.com and
            # chatgpt.com; OpenCode fetches @opencode-ai/plugin from npm) goes to a proxy
            # that is not there and fails at once: a turn never needs the network
            **{
                k: OFFLINE_PROXY
                for k in (
                    "HTTP_PROXY",
                    "HTTPS_PROXY",
                    "ALL_PROXY",
                    "http_proxy",
                    "https_proxy",
                    "all_proxy",
                )
            },
            "NO_PROXY": "127.0.0.1,localhost,::1",
            "no_proxy": "127.0.0.1,localhost,::1",
        }

    def argv(self, prompt: str, session: str | None) -> list[str]:
        raise NotImplementedError

    def read(self, turn: Turn) -> None:
        """Fill ``turn.ok``, ``text``, ``session``, ``why`` from its output."""
        raise NotImplementedError


class ClaudeCode(Agent):
    """Claude Code: ``POST /v1/messages?beta=true`` streamed, ``X-Claude-Code-Session-Id``."""

    name = "claude"
    binary = "claude"
    package = "@anthropic-ai/claude-code"
    api = "/v1/messages"

    def env(self) -> dict[str, str]:
        env = super().env() | {
            "ANTHROPIC_BASE_URL": self.base_url,
            "ANTHROPIC_API_KEY": DUMMY_KEY,
            "ANTHROPIC_MODEL": self.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.model,  # background calls: the same model
            "ANTHROPIC_DEFAULT_SONNET_MODEL": self.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": self.model,
            "ANTHROPIC_SMALL_FAST_MODEL": self.model,
            "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, updates, reports
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1",
            "DISABLE_COST_WARNINGS": "1",
        }
        if self.max_output_tokens:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        return env

    def argv(self, prompt: str, session: str | None) -> list[str]:
        # -p: non-interactive; tools needing a permission are refused (no prompt), so the
        # agent's tool calls run read-only tools at most
        a = [str(self.bin), "-p", prompt, "--model", self.model, "--output-format", "json"]
        return a + (["--resume", session] if session else [])

    def read(self, turn: Turn) -> None:
        res = _last_json(turn.stdout)
        turn.result = res or {}
        turn.session = (res or {}).get("session_id")
        turn.text = str((res or {}).get("result") or "")
        turn.ok = bool(res and res.get("subtype") == "success" and not res.get("is_error")
                       and turn.text.strip())  # fmt: skip
        if not turn.ok:
            turn.why = f"result {res!r:.300}" if res else "no JSON result on stdout"


class Codex(Agent):
    """Codex: ``POST /v1/responses`` streamed, ``session-id`` header + ``prompt_cache_key``."""

    name = "codex"
    binary = "codex"
    package = "@openai/codex"
    api = "/v1/responses"

    def prepare(self) -> None:
        super().prepare()
        home = self.home / ".codex"
        home.mkdir(parents=True, exist_ok=True)
        lines = [
            f'model = "{self.model}"',
            'model_provider = "kvroute"',
            'approval_policy = "never"',  # exec: nobody to ask
            'sandbox_mode = "read-only"',  # the agent's commands may read, never write
            "check_for_update_on_startup = false",
            "[analytics]",
            "enabled = false",
            "[feedback]",
            "enabled = false",
            "[model_providers.kvroute]",
            'name = "kvroute"',
            f'base_url = "{self.base_url}/v1"',
            'env_key = "KVROUTE_API_KEY"',
            'wire_api = "responses"',  # Codex 0.171 refuses "chat"
        ]
        (home / "config.toml").write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        return super().env() | {"CODEX_HOME": str(self.home / ".codex"),
                                "KVROUTE_API_KEY": DUMMY_KEY}  # fmt: skip

    def argv(self, prompt: str, session: str | None) -> list[str]:
        base = [str(self.bin), "exec"]
        if session:
            base += ["resume", session]
        return [*base, "--skip-git-repo-check", "--json", prompt]

    def read(self, turn: Turn) -> None:
        events = _json_lines(turn.stdout)
        texts = []
        for e in events:
            if e.get("type") == "thread.started":
                turn.session = e.get("thread_id")
            item = e.get("item") or {}
            if e.get("type") == "item.completed" and item.get("type") == "agent_message":
                texts.append(str(item.get("text") or ""))
        done = [e for e in events if e.get("type") == "turn.completed"]
        bad = [e for e in events if e.get("type") in ("turn.failed", "error")]
        turn.result = done[-1] if done else {}
        turn.text = texts[-1] if texts else ""
        turn.ok = bool(done and not bad and turn.text.strip())
        if not turn.ok:
            turn.why = f"events {[e.get('type') for e in events]}; {bad[:1]!r:.300}"


class OpenCode(Agent):
    """OpenCode: ``POST /v1/chat/completions`` streamed (AI SDK openai-compatible),
    ``x-session-id`` (+ ``x-session-affinity``)."""

    name = "opencode"
    binary = "opencode"
    package = "opencode-ai"
    api = "/v1/chat/completions"

    @property
    def config_path(self) -> Path:
        return self.home / "opencode.json"

    def prepare(self) -> None:
        super().prepare()
        model: dict[str, Any] = {"name": self.model}
        if self.max_output_tokens:
            model["limit"] = {"context": 16384, "output": self.max_output_tokens}
        cfg = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "model": f"kvroute/{self.model}",
            "small_model": f"kvroute/{self.model}",
            # the agent's file edits stay in its project folder; no shell, no web
            "permission": {"bash": "deny", "webfetch": "deny", "external_directory": "deny"},
            "provider": {
                "kvroute": {
                    "npm": "@ai-sdk/openai-compatible",  # bundled: nothing fetched at run time
                    "name": "kvroute",
                    "options": {"baseURL": f"{self.base_url}/v1", "apiKey": DUMMY_KEY},
                    "models": {self.model: model},
                }
            },
        }
        self.config_path.write_text(json.dumps(cfg, indent=2))

    def env(self) -> dict[str, str]:
        return super().env() | {
            "OPENCODE_CONFIG": str(self.config_path),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no models.dev catalogue download
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # read no ~/.claude prompts or skills
            "OPENCODE_PURE": "1",  # no external plugins (none installed from npm)
        }

    def argv(self, prompt: str, session: str | None) -> list[str]:
        a = [str(self.bin), "run", "--format", "json"]
        return a + (["--session", session] if session else []) + [prompt]

    def read(self, turn: Turn) -> None:
        events = _json_lines(turn.stdout)
        texts = [str((e.get("part") or {}).get("text") or "") for e in events
                 if e.get("type") == "text"]  # fmt: skip
        finishes = [(e.get("part") or {}) for e in events if e.get("type") == "step_finish"]
        errors = [e for e in events if e.get("type") == "error"]
        turn.session = next((e.get("sessionID") for e in events if e.get("sessionID")), None)
        turn.text = texts[-1] if texts else ""
        turn.result = finishes[-1] if finishes else {}
        turn.ok = bool(finishes and finishes[-1].get("reason") == "stop" and not errors
                       and turn.text.strip())  # fmt: skip
        if not turn.ok:
            turn.why = f"finishes {[f.get('reason') for f in finishes]}; {errors[:1]!r:.300}"


AGENTS: dict[str, type[Agent]] = {a.name: a for a in (ClaudeCode, Codex, OpenCode)}


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                v = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(v, dict):
                out.append(v)
    return out


def _last_json(text: str) -> dict[str, Any] | None:
    objs = _json_lines(text)
    if objs:
        return objs[-1]
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return None
    return v if isinstance(v, dict) else None


async def run_turn(agent: Agent, index: int, prompt: str, session: str | None,
                   timeout_s: float = 300.0) -> Turn:  # fmt: skip
    """Run one turn (``session``: continue that one) and read its result."""
    (agent.home / "tmp").mkdir(parents=True, exist_ok=True)
    argv = agent.argv(prompt, session)
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=agent.workdir, env=agent.env(), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        rc = proc.returncode if proc.returncode is not None else -1
    except TimeoutError:
        _kill_group(proc.pid)
        out, err = await proc.communicate()
        rc = 124
    finally:
        _kill_group(proc.pid)  # helpers the CLI left behind (its own process group)
    turn = Turn(agent.name, index, argv, rc, out.decode(errors="replace"),
                err.decode(errors="replace"), time.monotonic() - t0)  # fmt: skip
    agent.read(turn)
    if rc != 0:
        turn.ok = False
        turn.why = f"exit {rc}; {turn.why}; stderr: {turn.stderr[-600:]}"
    return turn


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_session(agent: Agent, prompts: list[str], timeout_s: float = 300.0) -> list[Turn]:
    """The turns of one session: the first starts it, each later one resumes it by id."""
    agent.prepare()
    turns: list[Turn] = []
    session = None
    for i, prompt in enumerate(prompts):
        t = await run_turn(agent, i, prompt, session, timeout_s)
        turns.append(t)
        if not t.ok:
            break
        session = session or t.session
    return turns
