"""The replica twin: a simulated vLLM replica that speaks vLLM's API, metrics and KV events.

:mod:`.engine` (vLLM v1's scheduler and block pool as a model without a model or a clock),
:mod:`.replica` (the engine in compressed real time), :mod:`.server` (the OpenAI-compatible
API), :mod:`.publisher` (ZMQ KV events), :mod:`.exporter` (``/metrics``), :mod:`.tokenize`
(vLLM-parity tokens through :mod:`router.vllm`), :mod:`.cluster` (N twins in one process).
The cluster simulator that reuses the engine model lives in :mod:`loadtest.sim`.
"""

# A replay tells a twin where a call's recorded output ends in this ``vllm_xargs`` key (vLLM
# hands vllm_xargs to its sampler; no router reads them), so no router sees the length.
TWIN_OUTPUT_FIELD = "kvroute_twin_output_tokens"


def expect_key(body: dict) -> str | None:
    """The key a replay registers a call's recorded output length under, out of band
    (``POST /twin/expect`` on a twin): a digest of the request's last message (chat, Messages,
    Responses input) or prompt — what every router forwards unchanged. Peer routers that
    re-serialize a request into their own typed schema (sglang-router 0.3.2 and vllm-router
    0.1.17 drop ``vllm_xargs``) then still let the twin stop where the recorded call did."""
    import hashlib

    import orjson

    last: object = None
    msgs = body.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict):
        last = [len(msgs), msgs[-1].get("content")]
    elif isinstance(body.get("input"), list | str):
        inp = body["input"]
        last = [len(inp), inp[-1]] if isinstance(inp, list) and inp else inp
    elif isinstance(body.get("prompt"), str | list):
        last = body["prompt"]
    if last is None:
        return None
    return hashlib.sha256(orjson.dumps(last)).hexdigest()[:32]
