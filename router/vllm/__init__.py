"""What must match vLLM byte for byte, for the router and the replica twin alike.

:mod:`.hashing` (chained block hashes, ``sha256_cbor`` and friends), :mod:`.kvevents` (the KV
event wire format), :mod:`.chat_template` (vLLM's chat rendering and the prompt a request
body becomes) and :mod:`.tokenizer` (a model directory's tokenizer and template). Checked
against the real engine in the vllm test tier. Imports neither vllm nor transformers.
"""
