"""router.redis_store without a server: the factory's choice of back end and what a store
answers before it ever reached Redis (the Redis behaviour itself, against a real server:
tests/integration/test_router_redis.py and test_router_outage.py)."""

from __future__ import annotations

from router.redis_store import RedisStore, make_store
from router.state import MemoryStore


async def test_make_store_picks_the_back_end_from_the_url():
    mem = make_store(None, ttl_s=60)
    assert isinstance(mem, MemoryStore) and mem.backend == "memory"
    red = make_store("redis://127.0.0.1:1/0", ttl_s=60, timeout_s=0.05)
    try:
        assert isinstance(red, RedisStore) and red.backend == "redis"
        assert isinstance(red.local, MemoryStore) and red.local.ttl_s == 60
    finally:
        await red.close()


async def test_a_store_whose_redis_is_away_serves_from_its_local_view():
    from router.sessions import identify

    st = RedisStore("redis://127.0.0.1:1/0", ttl_s=60, timeout_s=0.2)  # nothing listens
    try:
        ident = identify({"x-session-id": "s"}, {})
        rec = await st.begin_call(ident, now=1.0)  # must not raise
        assert rec.calls == 1 and not st.up
        assert await st.claim(ident.key, "r1") == "r1"
        assert await st.claim(ident.key, "r2") == "r1"  # the local view's first placement
        assert st.pending_writes >= 1  # written back when Redis returns
    finally:
        await st.close()
