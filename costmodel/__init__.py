"""Pure cost and time models: hardware+model profiles, prefill/decode/fetch times, placement cost.

Must not do I/O or import aiohttp, httpx, redis, zmq or the router.
"""
