"""A process-group watchdog: ``python -m loadtest.reaper OWNER_PID -- ARGV...``.

Owns: running ARGV as its child inside the reaper's own process group (the caller starts the
reaper with ``process_group=0``) and making sure that whole group dies when either
the child exits or the owner process (OWNER_PID) disappears — even if the owner was
SIGKILLed and could run no teardown. Grandchildren (vLLM's engine core) share the group, so
they go too. Graceful stops stay the owner's job (SIGTERM to the group, which the reaper
ignores, then SIGKILL). Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m loadtest.reaper OWNER_PID -- ARGV...", file=sys.stderr)
        return 2
    owner = int(argv[0])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server
    child = subprocess.Popen(
        argv[2:], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)
    )
    code = 0
    while True:
        rc = child.poll()
        if rc is not None:
            code = rc
            break
        if os.getppid() != owner:  # reparented: the owner is gone
            code = 137
            break
        time.sleep(0.2)
    os.killpg(0, signal.SIGKILL)  # sweep the whole group, the reaper included
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
