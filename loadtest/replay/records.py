"""What a replay records: one row per call, one per session play, queue samples.

Owns: :class:`CallRecord`, :class:`SessionRecord`, :class:`QueueSample` and their JSONL
round trip. Times are seconds on the client's monotonic clock since the run started, as
measured (not scaled by a twin's speedup: :mod:`loadtest.metrics` does that). Pure data: no
HTTP, no router imports.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar


@dataclass
class CallRecord:
    session: str
    play: int
    call: str
    agent: str
    t_start: float
    t_end: float
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first
    prompt_tokens: int = 0  # as the server reported (usage), else as predicted
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    expected_prompt_tokens: int = 0  # what the prompt builder predicted
    bound_cached_tokens: int = 0  # what an unlimited cache would have held
    replica: str | None = None  # from the router's response header, when sent
    lane: int = 0
    status: int | None = None  # HTTP status
    error: str | None = None

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start


@dataclass
class SessionRecord:
    session: str
    play: int
    lane: int
    t_start: float
    t_end: float
    calls: int
    complete: bool  # every call ran and succeeded
    # stopped by the run's --duration bound before every call had ended (a call not started,
    # or cancelled after the grace); t_end is then when the play was stopped
    cut: bool = False


@dataclass
class QueueSample:
    t: float
    in_flight: int  # calls this client has sent and not finished
    waiting: float | None = None  # sum of vllm:num_requests_waiting over scraped replicas
    running: float | None = None


T = TypeVar("T")


def write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_jsonl(path: Path, cls: type[T]) -> list[T]:
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(cls(**{k: v for k, v in d.items() if k in names}))
    return out
