"""What a child forked by the fork server (``launch/forkserver.py``) does to become the
process of the command its shim asked for: close what it inherited from the server, take
over the shim's standard streams, folder, environment, arguments and network namespace, get
what a new process would have (``sys.path``, signal dispositions, seeds, thread count, process
name), stop when its shim is gone, and run the command's entry point.

The fork server loads this file by its path (it runs with ``python -P``: its folder is not
on the import path), so it must stay self-contained and stdlib-only at import, as the fork
server must: the SuperExec image (``deploy/superexec.Dockerfile``) copies the two files alone.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


def pythonpath(env: Mapping[str, str]) -> list[str]:
    """PYTHONPATH's folders, made absolute as Python makes them in ``sys.path`` at start."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def network_to_join(connection: socket.socket) -> str | None:
    """The network namespace of the shim at the other end, where it is not the server's
    (``/proc/<pid>/ns/net``); OSError (the request is refused) where only root could join
    it. Asked by the server before it forks."""
    pid, _, _ = struct.unpack("3i", connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    theirs = f"/proc/{pid}/ns/net"
    if os.stat(theirs).st_ino == os.stat("/proc/self/ns/net").st_ino:
        return None
    if os.geteuid() != 0:
        raise PermissionError("joining another network namespace needs root")
    return theirs


def close_inherited(selector: selectors.BaseSelector, handlers: Mapping[int, object],
                    mask: set[signal.Signals]) -> None:
    """In a child: the signal dispositions (``handlers``) and mask the server started with;
    close the server's listener, signal wake-up socket, pidfds and other shims' connections
    (its own is not registered yet: it stays open, to watch its shim through)."""
    with contextlib.suppress(OSError):
        os.close(signal.set_wakeup_fd(-1))
    for number, handler in handlers.items():
        signal.signal(number, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for key in list(selector.get_map().values()):
        if key.fileobj is sys.stdin:
            continue
        if key.data:
            key.data[1].close()
            os.close(key.fileobj)
        else:
            key.fileobj.close()
    selector.close()


def run_child(entry: Callable[[], object], request: dict, fds: list[int],
              connection: socket.socket, network: str | None, base_path: list[str],
              default_threads: int) -> None:
    """In the forked child: become the requested command's process (in its shim's network
    namespace), run its entry point, exit with its status (never returns)."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if network is not None:
            _join_network(network)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        # as the real command's process has it: its script's folder, PYTHONPATH, the rest
        sys.path[:] = [str(Path(sys.executable).parent), *pythonpath(os.environ),
                       *base_path]
        _name_process(Path(sys.argv[0]).name)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _reseed(default_threads)
        _stop_with_shim(connection)
        entry()
        code = 0
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else (leaving.code is not None)
        if not isinstance(leaving.code, int | None):
            print(leaving.code, file=sys.stderr)
    except BaseException:  # the child's last word, as Python's own exit would print it
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _join_network(namespace: str) -> None:
    """setns(2) into a network namespace (os.setns is Python 3.12+)."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(namespace, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns {namespace}")
    finally:
        os.close(fd)


def _reseed(default_threads: int) -> None:
    """What a new process would have: global generators seeded from the OS, and PyTorch's
    thread count from OMP_NUM_THREADS (OpenMP read the server's environment at import)."""
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else default_threads)


def _stop_with_shim(connection: socket.socket) -> None:
    """Kill the child when its shim is gone. The shim never writes, so a read returns only
    when its end closed; a shim sent a catchable signal forwards it and waits for the
    child, so one gone first was killed (SIGKILL of its process group: a crash)."""
    import threading

    def watch() -> None:
        with contextlib.suppress(OSError):
            connection.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="shim-watch", daemon=True).start()


def _name_process(name: str) -> None:
    """The child's process name (``ps``, ``pgrep``): the command's, not the server's."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
