"""What must match vLLM byte for byte, for the router and the replica twin alike.

:mod:`.hashing` (chained block hashes, ``sha256_cbor`` and friends), :mod:`.kvevents` (the KV
event wire format), :mod:`.chat_template` (vLLM's chat rendering), :mod:`.anthropic_messages`
and :mod:`.openai_responses` (the agent APIs' bodies as the chat request vLLM builds),
:mod:`.prompt` (the prompt a request body becomes) and :mod:`.tokenizer` (a model directory's
tokenizer and template). Checked against the real engine in the vllm test tier. Imports
neither vllm nor transformers.
"""
