"""The cluster simulator: N replica-twin engines in simulated time, no HTTP.

:mod:`.simulator` (the discrete-event loop, call records, AgentX summary, simulator-only
routing functions), :mod:`.router_policy` (the router's own call sequence as a routing
function), :mod:`.trace` (real traces as DAG sessions on the HTTP replay's lanes) and
:mod:`.cli` (``kvroute sim``). Depends on the twin's engine model, the harness's traces and
metrics, and the router; no sockets, no asyncio.
"""
