"""The KV layer: what the router knows about where each prompt's KV blocks live.

State, not policy: :mod:`.config` (typed settings), :mod:`.index` (block index by replica and
tier, fed by :mod:`.events`' ZMQ subscribers), :mod:`.approx` (approximate mode from routing
history), :mod:`.tokens` (incremental per-session tokenization), :mod:`.sessions` (session
footprints and replica statistics), :mod:`.view` (the read-only :class:`~.view.KVView` scorers
receive) and :mod:`.state` (:class:`~.state.KVState`, which ties them to a call's analyze and
observe steps). Installed with ``router.app.build_app(cfg, kv=KVState(cfg.kv))``. Must not
import aiohttp handlers, the proxy, torch or vllm.
"""
