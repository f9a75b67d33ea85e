"""Pure cost and time models: hardware+model profiles, prefill/decode/fetch times, placement cost.

Must not do I/O or import aiohttp, httpx, redis, zmq or the router — with one stated
exception: :func:`costmodel.profiles.load_profile` reads the package's own bundled profile
YAML (``costmodel/profiles/*.yaml``) by name, through one function (``_read_yaml``). It reads
no user path and no network; the profiles are the package's data, like constants. Moving the
read out would give ``router/`` and ``loadtest/`` each a loader for ``costmodel``'s own files.
Everything else here is a pure function of profiles and numbers.
"""
