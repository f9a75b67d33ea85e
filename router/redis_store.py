"""The session table in Redis (active-active across routers), and the store factory.

:class:`RedisStore` — a :class:`router.state.MemoryStore` as the *local view* plus one Redis
hash per session (``kvroute:s:<key>``) and a children set (``kvroute:c:<key>``). Every
operation updates the local view first, then Redis with a short timeout. When Redis fails the
store marks itself down, serves from the local view, remembers the keys it touched, and a
background task (``run()``) pings Redis; when it answers, the dirty keys are written back (an
owner already in Redis wins: another router may have placed the session meanwhile). The first
placement of a session is ``HSETNX`` so two routers racing on a new session agree on one
replica. :func:`make_store` builds the configured back end. Must not import aiohttp handlers,
scheduling or vllm.

Bindings through outages (issue 45): every change of a session's replica in Redis — first
placement or move — is one Lua script that sets it, bumps the session's binding version and
publishes ``[key, replica, version]`` on :attr:`RedisStore.CHANNEL`. Every router subscribes
and keeps the newest binding it heard for every session (:attr:`RedisStore.bindings`, its own
and the other routers'), so when Redis goes away all routers hold the same last binding —
also for a session the other router moved, or placed, and this one never served since. While
Redis is away a session keeps that binding; one without any (first seen during the outage)
or whose replica is unhealthy gets a rendezvous hash over the healthy replicas
(:func:`router.placement.place_session`): the same answer on every router, without Redis. When
Redis returns nothing moves back: bindings changed during the outage are written with the
same script (the rule gave every router the same one), the others with ``HSETNX``. What
this cannot cover: a binding change whose message had not reached the other router when
Redis stopped (the publish latency, about a millisecond on one network), or messages a
router missed while only its subscription was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import orjson
from redis.exceptions import RedisError

from router.sessions import SessionIdentity
from router.state import RECONCILE_BATCH, MemoryStore, SessionRecord

log = logging.getLogger("kvroute.redis_store")


# KEYS[1] the session's hash; ARGV: replica, "1" to place only if unbound (claim) else "0",
# the channel, the session key. Returns {owner, version}. One script: the set, the version
# and the publish are atomic, so messages arrive in version order.
_BIND = """
if ARGV[2] == '1' then
  local cur = redis.call('HGET', KEYS[1], 'replica')
  if cur then return {cur, tonumber(redis.call('HGET', KEYS[1], 'ver') or '0')} end
end
redis.call('HSET', KEYS[1], 'replica', ARGV[1])
local v = redis.call('HINCRBY', KEYS[1], 'ver', 1)
redis.call('PUBLISH', ARGV[3], cjson.encode({ARGV[4], ARGV[1], v}))
return {ARGV[1], v}
"""


class RedisStore:
    """Redis-backed table with a local view that keeps serving while Redis is away."""

    backend = "redis"
    PREFIX = "kvroute:s:"
    CHILDREN = "kvroute:c:"
    CHANNEL = "kvroute:bindings"

    def __init__(
        self,
        url: str,
        ttl_s: float = 3600.0,
        timeout_s: float = 0.25,
        reconcile_interval_s: float = 1.0,
    ):
        import redis.asyncio as aioredis

        self.url = url
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.reconcile_interval_s = reconcile_interval_s
        self.local = MemoryStore(ttl_s)
        self._r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry_on_timeout=False, decode_responses=True,
        )  # fmt: skip
        self._up = True
        self._dirty: set[str] = set()
        self._bind = self._r.register_script(_BIND)
        # the newest binding heard for every session (own and other routers'): key ->
        # (replica, version, time.monotonic() when heard); the outage's shared answer
        self.bindings: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._moved_offline: set[str] = set()  # bindings changed while Redis was away
        self.heard = 0  # binding messages applied
        self.reconciles = 0
        self.adopted = 0  # sessions whose binding was taken from Redis on reconcile
        self.outages = 0  # times the store went from up to down
        self._wake = asyncio.Event()

    @property
    def up(self) -> bool:
        return self._up

    @property
    def pending_writes(self) -> int:
        """Sessions touched while Redis was away, not yet written back."""
        return len(self._dirty)

    def _down(self, err: BaseException, key: str | None) -> None:
        if self._up:
            log.warning("redis unreachable (%s): serving sessions from the local view",
                        type(err).__name__)  # fmt: skip
            self.outages += 1
        self._up = False
        if key:
            self._dirty.add(key)
        self._wake.set()

    async def _do(self, key: str | None, coro_fn: Any) -> Any:
        if not self._up:
            if key:
                self._dirty.add(key)
            return None
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                return await coro_fn()
        except (TimeoutError, OSError, RedisError) as e:
            self._down(e, key)
            return None
        except Exception:  # a bug or a corrupt record: not an outage, so do not flap
            log.exception("session store operation failed (redis is up)")
            if key:
                self._dirty.add(key)
            return None

    def _fields(self, rec: SessionRecord) -> dict[str, str]:
        f = {
            "tenant": rec.tenant,
            "created": repr(rec.created),
            "last_seen": repr(rec.last_seen),
            "calls": str(rec.calls),
            "gaps": orjson.dumps(rec.gaps).decode(),
            "final": "1" if rec.final else "0",
        }
        if rec.parent:
            f["parent"] = rec.parent
        if rec.agent:
            f["agent"] = rec.agent
        if rec.last_call_end is not None:
            f["last_call_end"] = repr(rec.last_call_end)
        return f

    @staticmethod
    def _parse(h: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if h.get("replica"):
            out["replica"] = h["replica"]
        if h.get("last_call_end"):
            out["last_call_end"] = float(h["last_call_end"])
        if h.get("calls"):
            out["calls"] = int(h["calls"])
        if h.get("created"):
            out["created"] = float(h["created"])
        return out

    def _heard(self, key: str, replica: str, ver: int) -> None:
        """A binding from Redis (a message, a read, a script's answer): kept when newer than
        the one held, and applied to the local record."""
        cur = self.bindings.get(key)
        if cur is not None and cur[1] >= ver and cur[0] != replica:
            return  # an older change, arriving late
        self.bindings[key] = (replica, ver, time.monotonic())
        self.bindings.move_to_end(key)
        while len(self.bindings) > self.local.max_sessions:
            self.bindings.popitem(last=False)
        rec = self.local._d.get(key)
        if rec is not None:
            rec.replica = replica

    def _on_message(self, data: str) -> None:
        try:
            key, replica, ver = orjson.loads(data)
            self._heard(str(key), str(replica), int(ver))
            self.heard += 1
        except (ValueError, TypeError):
            log.warning("malformed binding message on %s; ignored", self.CHANNEL)

    async def _listen(self) -> None:
        """Follow every binding change (the channel) on a connection of its own, without a
        read timeout (it is idle between changes); reconnect with back-off when it drops."""
        import redis.asyncio as aioredis

        delay = 0.1
        while True:
            client = aioredis.Redis.from_url(
                self.url, socket_connect_timeout=self.timeout_s, decode_responses=True
            )
            ps = client.pubsub(ignore_subscribe_messages=True)
            try:
                await ps.subscribe(self.CHANNEL)
                delay = 0.1
                async for msg in ps.listen():
                    if msg.get("type") == "message":
                        self._on_message(msg["data"])
            except (OSError, RedisError) as e:
                log.debug("binding subscription dropped: %s", type(e).__name__)
            finally:
                with contextlib.suppress(Exception):
                    await ps.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def begin_call(self, ident: SessionIdentity, now: float) -> SessionRecord:
        rec = self.local.touch(ident, now)
        k = self.PREFIX + ident.key

        async def op() -> None:
            remote = await self._r.hgetall(k)
            if remote:
                # calls and timing seen by other routers count too
                prev_end = rec.last_call_end
                self.local.merge_remote(ident.key, self._parse(cast(dict[str, str], remote)))
                if rec.last_call_end is not None and rec.last_call_end != prev_end:
                    gap = max(0.0, now - rec.last_call_end)
                    if prev_end is not None and rec.gaps:
                        rec.gaps[-1] = gap
                    else:
                        rec.gaps.append(gap)
                rec.calls = max(rec.calls, int(remote.get("calls", 0)) + 1)
                if remote.get("replica"):
                    self._heard(ident.key, str(remote["replica"]), int(remote.get("ver") or 0))
            async with self._r.pipeline(transaction=False) as p:
                p.hset(k, mapping=cast(Any, self._fields(rec)))
                p.expire(k, int(self.ttl_s))
                if rec.parent:
                    p.sadd(self.CHILDREN + rec.parent, ident.key)
                    p.expire(self.CHILDREN + rec.parent, int(self.ttl_s))
                await p.execute()

        await self._do(ident.key, op)
        if not self._up:  # away (perhaps found so just now): the newest binding heard
            b = self.bindings.get(ident.key)
            if b is not None:
                rec.replica = b[0]
        return rec.copy()

    async def claim(self, key: str, replica: str) -> str:
        local_owner = await self.local.claim(key, replica)

        async def op() -> tuple[str, int]:
            owner, ver = await self._bind(keys=[self.PREFIX + key],
                                          args=[replica, "1", self.CHANNEL, key])  # fmt: skip
            return str(owner or replica), int(ver or 0)

        res = await self._do(key, op)
        if res is None:
            return local_owner
        self._heard(key, *res)
        await self.local.assign(key, res[0])
        return res[0]

    async def assign(self, key: str, replica: str) -> None:
        await self.local.assign(key, replica)

        async def op() -> tuple[str, int]:
            owner, ver = await self._bind(keys=[self.PREFIX + key],
                                          args=[replica, "0", self.CHANNEL, key])  # fmt: skip
            return str(owner), int(ver)

        res = await self._do(key, op)
        if res is None:  # away: the outage rule chose it; written back as a move
            self._moved_offline.add(key)
            b = self.bindings.get(key)
            self.bindings[key] = (replica, b[1] if b else 0, time.monotonic())
            return
        self._heard(key, *res)

    async def end_call(self, key: str, now: float) -> None:
        self.local.finish(key, now)
        await self._do(key, lambda: self._r.hset(self.PREFIX + key, "last_call_end", repr(now)))

    async def get(self, key: str) -> SessionRecord | None:
        return await self.local.get(key)

    def add_service(self, key: str, tokens: int) -> None:
        self.local.add_service(key, tokens)  # this router's share (not shared in Redis)

    def priority_inputs(self, key: str) -> tuple[int, str]:
        return self.local.priority_inputs(key)

    def active_count(self) -> int:
        return self.local.active_count()

    def list(self, limit: int = 100) -> list[SessionRecord]:
        return self.local.list(limit)

    async def _write_back(self, keys: Sequence[str], moved: set[str]) -> None:
        """Write the sessions ``keys`` back in one pipeline: their fields, and their binding
        — as a move when the outage rule changed it (``moved``), else placed only if Redis
        has none (an owner already there wins and is adopted)."""
        recs = [(key, self.local._d[key]) for key in keys if key in self.local._d]
        async with self._r.pipeline(transaction=False) as p:
            bound = []
            for key, rec in recs:
                k = self.PREFIX + key
                p.hset(k, mapping=cast(Any, self._fields(rec)))
                p.expire(k, int(self.ttl_s))
                if rec.parent:
                    p.sadd(self.CHILDREN + rec.parent, key)
                if rec.replica:
                    flag = "0" if key in moved else "1"
                    await self._bind(keys=[k], args=[rec.replica, flag, self.CHANNEL, key],
                                     client=p)  # fmt: skip
                    bound.append((key, rec))
            res = await p.execute()
        scripts = [r for r in res if isinstance(r, list)]  # the scripts' {owner, version}
        for (key, rec), (owner, ver) in zip(bound, scripts, strict=True):
            self._heard(key, str(owner), int(ver or 0))
            if rec.replica != str(owner):
                rec.replica = str(owner)  # another router's binding won
                self.adopted += 1

    async def reconcile(self) -> bool:
        """Ping Redis; when it answers, write back what changed while it was away and adopt
        the owner Redis holds for each of those sessions (``HSETNX``: a binding another
        router wrote first wins, here too, so the routers' views agree again at once).

        While Redis is away the connection pool is dropped before each probe: a restarted
        Redis leaves the pool's sockets dead, and reusing them would fail the first
        operations after the ping succeeded (the router would flap down and up again)."""
        try:
            if not self._up:
                with contextlib.suppress(Exception):
                    await self._r.connection_pool.disconnect()
            async with asyncio.timeout(self.timeout_s * 4):
                await self._r.ping()
            dirty, self._dirty = self._dirty, set()
            moved, self._moved_offline = self._moved_offline, set()
            keys = [k for k in dirty if k in self.local._d]
            for i in range(0, len(keys), RECONCILE_BATCH):  # one round trip per batch
                async with asyncio.timeout(self.timeout_s * 4):
                    await self._write_back(keys[i : i + RECONCILE_BATCH], moved)
                dirty.difference_update(keys[i : i + RECONCILE_BATCH])
                moved.difference_update(keys[i : i + RECONCILE_BATCH])
        except Exception as e:  # still away: keep the dirty keys for next time
            self._dirty |= locals().get("dirty", set())
            self._moved_offline |= locals().get("moved", set())
            log.debug("redis still unreachable: %s", e)
            return False
        if not self._up:
            log.warning("redis is back: reconciled %d sessions", len(keys))
            # a restarted Redis counts binding versions from 0 again: keep the bindings,
            # forget their versions, so the changes published from now on are taken
            for key, (replica, _, at) in list(self.bindings.items()):
                self.bindings[key] = (replica, 0, at)
        self._up = True
        self.reconciles += 1
        return True

    async def run(self) -> None:
        listen = asyncio.create_task(self._listen(), name="kvroute-store-bindings")
        try:
            await self._run()
        finally:
            listen.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listen

    async def _run(self) -> None:
        sweep_every = max(1.0, min(60.0, self.ttl_s / 4))
        last_sweep = time.monotonic()
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(self.reconcile_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if not self._up or self._dirty:
                await asyncio.sleep(self.reconcile_interval_s)
                await self.reconcile()
            if time.monotonic() - last_sweep > sweep_every:
                self.local.sweep()
                self._sweep_bindings()
                last_sweep = time.monotonic()

    def _sweep_bindings(self) -> None:
        """Forget bindings not heard of for ``ttl_s`` (oldest first: the map is in order)."""
        cutoff = time.monotonic() - self.ttl_s
        while self.bindings:
            _, (_, _, at) = next(iter(self.bindings.items()))
            if at >= cutoff:
                break
            self.bindings.popitem(last=False)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._r.aclose()


def make_store(
    redis_url: str | None, ttl_s: float, timeout_s: float = 0.25, reconcile_interval_s: float = 1.0
) -> MemoryStore | RedisStore:
    if redis_url:
        return RedisStore(redis_url, ttl_s, timeout_s, reconcile_interval_s)
    return MemoryStore(ttl_s)
