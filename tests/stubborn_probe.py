"""A command for tests/test_forkserver_stop.py to start through a fork server: it ignores
SIGTERM (as a process stuck in its own shutdown would) and waits to be killed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from common.durable import write_atomic


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # atomically: the test polls for the file and must never read it half written
    write_atomic(Path(sys.argv[1]), lambda f: f.write(str(os.getpid()).encode()))
    while True:
        time.sleep(0.1)
