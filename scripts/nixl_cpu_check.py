"""Does NIXL's UCX transport run on a CPU-only host? (docs/engine.md, "P/D disaggregation")

Two NIXL agents in one process, host memory registered as ``DRAM``, one ``READ`` from A's
buffer into B's. Run with the ``nixl-cu12`` wheel unpacked on ``PYTHONPATH`` (no CUDA device
is needed): ``pip download --no-deps nixl-cu12 && unzip nixl_cu12-*.whl -d site &&
PYTHONPATH=site python scripts/nixl_cpu_check.py``. Prints ``state DONE equal True`` when it
works. Not part of the product or the tests.
"""

import time

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

cfg = nixl_agent_config(backends=["UCX"])
a = nixl_agent("A", cfg)
b = nixl_agent("B", cfg)
print("backends", a.get_plugin_list())
src = np.arange(1 << 16, dtype=np.uint8)
dst = np.zeros(1 << 16, dtype=np.uint8)
sa = a.register_memory(a.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
sb = b.register_memory(b.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
b.add_remote_agent(a.get_agent_metadata())
local = b.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
remote = b.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
h = b.initialize_xfer("READ", local, remote, "A")
st = b.transfer(h)
t0 = time.time()
while (st := b.check_xfer_state(h)) not in ("DONE", "ERR") and time.time() - t0 < 10:
    time.sleep(0.01)
print("state", st, "equal", bool((src == dst).all()))
