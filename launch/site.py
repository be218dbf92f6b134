"""``pflower-supernode``: Flower's ``flower-supernode``, its ClientApps started warm.

A SuperNode starts a fresh ``flwr-clientapp`` process for every message it receives, and each
spends 2-4 s importing Flower and PyTorch before 0.05-0.5 s of work. ``pflower-supernode``
takes exactly ``flower-supernode``'s arguments and runs it with a fork server's
``flwr-clientapp`` shim first on its ``PATH`` (``launch/forkserver.py``, the SuperExec
image's ``--exec`` mode): the server imports Flower, PyTorch and NumPy once, and each
message's ClientApp is a child forked from it.

The SuperExec that ``flower-supernode`` starts (``flower-superexec``, found on the same
``PATH``) is forked from it too, so that it stops with its SuperNode: Flower's SuperNode
leaves it running when it exits, and the SuperExec, which looks for its parent every 0.2 s,
acts on that only once its current retry's wait is over (up to 20 s: the signal it raises is
handled by its main thread). The fork server stops its children as soon as the SuperNode is
gone (``kill`` of the SuperNode, or its crash), removes its folder and exits: a few seconds
after the SuperNode, nothing of the site is left.

- Isolation as before: every message still runs in a process of its own, with the
  SuperNode's environment and working folder; a ClientApp that crashes or is killed takes
  only its own child with it.
- The app is never imported by the fork server, so the app version (FAB) the SuperNode
  installed for a run is the one that runs, also when it changed since the last run.
- GPUs: CUDA is initialised in each child, never in the fork server.
- Memory: one more process per site (the fork server), whose pages its children share
  copy-on-write.
- Off: ``PFLOWER_WARM_CLIENTAPPS=0``. Where the fork server cannot run (not Linux, no Unix
  sockets, the server fails to start), plain ``flower-supernode`` runs, and one line says why.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence

from launch.forkserver import COMMANDS, exec_beside_fork_server

OFF_ENV = "PFLOWER_WARM_CLIENTAPPS"
READY_SECONDS = 120  # the fork server's imports, on a slow or busy site
# flower-supernode's SuperExec, and the ClientApp it starts for each message
SITE_COMMANDS = {"flower-superexec": "flwr.supercore.cli:flower_superexec",
                 "flwr-clientapp": COMMANDS["flwr-clientapp"]}


def why_not_warm() -> str | None:
    """Why this site cannot start its ClientApps warm (None: it can)."""
    if os.environ.get(OFF_ENV, "1") == "0":
        return f"{OFF_ENV}=0"
    if not sys.platform.startswith("linux"):
        return f"the fork server needs Linux, not {sys.platform}"
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "pidfd_open"):
        return "this Python has no Unix sockets or pidfds"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """``pflower-supernode ARGS``: become ``flower-supernode ARGS``, warm where it can."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Flower's commands from the environment this one is installed in, whether or not it is
    # activated (a site may run .venv/bin/pflower-supernode): flower-supernode, and the
    # flwr-clientapp it starts for each message
    installed = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([installed, os.environ.get("PATH", "")])
    reason = why_not_warm()
    if reason is None:
        try:
            exec_beside_fork_server(["flower-supernode", *args], SITE_COMMANDS,
                                    wait=READY_SECONDS)
        except (OSError, RuntimeError) as error:
            reason = str(error)
    print(f"pflower-supernode: ClientApps start cold ({reason}); running plain "
          "flower-supernode", file=sys.stderr, flush=True)
    os.execvp("flower-supernode", ["flower-supernode", *args])
