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
