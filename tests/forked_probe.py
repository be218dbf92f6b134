"""A command for tests/test_forkserver.py to start through a fork server: it reports what
its process sees, exits with a given status, or waits to be stopped."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from common.durable import write_atomic


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "report":
        import torch

        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "ppid": os.getppid(),
                          "marker": os.environ.get("PROBE_MARKER"),
                          "threads": torch.get_num_threads(),
                          "network": os.stat("/proc/self/ns/net").st_ino,
                          "path_has": [p for p in sys.path if p.endswith("probe-extra")]}))
    elif command == "exit":
        print("leaving", file=sys.stderr)
        sys.exit(int(args[0]))
    elif command == "wait":  # until a signal stops it
        # atomically: the test polls for the file and must never read it half written
        write_atomic(Path(args[0]), lambda f: f.write(str(os.getpid()).encode()))
        while True:
            time.sleep(0.1)
