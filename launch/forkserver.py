"""Flower's per-run and per-message processes started warm: forked from a process that has
already imported Flower, PyTorch and Ray, instead of started and imported from scratch.

Flower starts a fresh ``flwr-simulation`` process for every run and a fresh ``flwr-clientapp``
for every message a SuperNode receives; each spends 2-4 s of CPU importing Flower, PyTorch and
Ray before 0.05-0.5 s of work. Flower finds both commands on ``PATH``; a launcher that puts
``ForkServer.bin_dir`` first on the ``PATH`` of the SuperLink or SuperNode it starts gets
them from here:

- the fork server (``python -P launch/forkserver.py SOCKET COMMANDS``) imports what both
  commands need once, then waits on a Unix socket;
- each command on ``bin_dir`` is a stdlib-only shim (~0.04 s) that hands the server its
  arguments, environment, working folder and standard streams; the server forks a child that
  takes them over and calls the entry point the real command calls (``launch/forkchild.py``:
  what the child does to become the real command's process);
- the shim forwards SIGTERM/SIGINT/SIGHUP to the child and exits as it exits (its code, or its
  signal); a child whose shim is gone (SIGKILL of its process group) is stopped; with no fork
  server reachable, the shim runs the real command;
- the server lives as long as its launcher (the process that holds its stdin): once that is
  gone, it stops the children it forked (SIGTERM, then SIGKILL after ``STOP_GRACE_SECONDS``),
  removes its private folder (socket, shims, log) and exits; SIGTERM, SIGINT or SIGHUP to
  the server itself removes the folder too (its children stop with their shims);
- a shim in another network namespace (``LocalDeployment(namespaces=True)``) gets a child that
  joins it; where the server may not (not root), the shim runs the real command.

Seeds are unaffected: the app seeds what it uses from its run config; Python's and NumPy's
global generators are re-seeded from the OS in every child, and PyTorch's threads follow the
child's ``OMP_NUM_THREADS``, as in a new process. The app's SuperExec image
(``deploy/superexec.Dockerfile``) starts ``flower-superexec`` this way too
(``python -P forkserver.py --exec flower-superexec ARGS...``), so a site's ClientApps and the
ServerApp start warm in a container. This file and ``launch/forkchild.py``, which it loads by
its path, must stay self-contained and stdlib-only at import (the image copies the two alone).

A launcher's handle on a fork server of its own is ``launch/warm_start.py: ForkServer``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType


def _load_sibling(name: str) -> ModuleType:
    """``name``.py beside this file, loaded by its path: run as a script with -P (the server,
    the SuperExec image's entrypoint), this file's folder is not on the import path."""
    spec = importlib.util.spec_from_file_location(
        f"pflower_{name}", Path(__file__).resolve().with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What a forked child does to become its command's process (launch/forkchild.py)
forkchild = _load_sibling("forkchild")

# The commands a fork server starts (their console-script entry points, as Flower's package
# declares them), and the modules it imports for them in advance
COMMANDS = {"flwr-simulation": "flwr.simulation.app:flwr_simulation",
            "flwr-serverapp": "flwr.superlink.cli:flwr_serverapp",
            "flwr-clientapp": "flwr.supernode.cli:flwr_clientapp"}
# those that are installed: Ray only where simulations run (not in the SuperExec image)
PRELOAD = ("torch", "numpy", "ray", "flwr.serverapp", "flwr.clientapp")
SOCKET_ENV = "PFLOWER_FORKSERVER"
READY = b"ready"
START_TIMEOUT_SECONDS = 300  # for the server's imports, on a busy machine
FOLDER_PREFIX = "pflower-fork-"
SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path, less its final NUL)
# Signals that stop the server; its children are forked with them blocked, then get back
# the dispositions the server started with (what a new process would have)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How long the children of a server whose launcher is gone get for SIGTERM before SIGKILL:
# a ClientApp or a SuperExec exits on SIGTERM within a second
STOP_GRACE_SECONDS = 2.0
_original_handlers: dict[int, object] = {}
# Read once, when Flower and Ray are imported: the server is given the values the launchers
# give the processes they start (launch/federation.py)
IMPORT_TIME_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
                   "PYTHONUNBUFFERED": "1"}

# The shim, filled in per command; stdlib only and run with -IS, so that it starts in
# ~0.04 s. Its protocol: one request (JSON + the three standard streams), then the child's
# pid, then its exit status (a negative number: the signal that ended it).
SHIM = '''#!{python} -IS
import json, os, signal, socket, sys
REAL = {real!r}
path = os.environ.get({socket_env!r}, "")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    sock.connect(path)
    request = {{"command": {command!r}, "argv": sys.argv, "cwd": os.getcwd(),
               "env": dict(os.environ)}}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    pid = int(sock.recv(64))
except (OSError, ValueError):
    sock.close()
    os.execv(REAL, [REAL, *sys.argv[1:]])
def forward(number, _):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, forward)
reply = sock.recv(64)
status = int(reply) if reply else 1
if status < 0:
    if -status != signal.SIGKILL:
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
'''


def private_folder() -> Path:
    """Where a fork server's socket and shims live: a private folder in the temporary
    folder (``TMPDIR``, else /tmp), or in /tmp where the socket's path would be too long
    for a Unix socket."""
    base = tempfile.gettempdir()
    longest = os.path.join(base, FOLDER_PREFIX + "x" * 8, "socket")  # mkdtemp adds 8
    if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=base))


def server_command(socket_path: Path, commands: Mapping[str, str]) -> list[str]:
    """The fork server's command line. -P and the file's path: neither the launcher's folder
    nor the repository is on the server's import path, so that a child imports what the real
    command would."""
    return [sys.executable, "-P", str(Path(__file__).resolve()), str(socket_path),
            json.dumps(dict(commands))]


def write_shims(bin_dir: Path, commands: Mapping[str, str]) -> None:
    """A shim in ``bin_dir`` for each command (the real one: beside this Python)."""
    real_bin = Path(sys.executable).parent
    bin_dir.mkdir()
    for command in commands:
        shim = bin_dir / command
        shim.write_text(SHIM.format(python=sys.executable, real=str(real_bin / command),
                                    socket_env=SOCKET_ENV, command=command))
        shim.chmod(0o755)


def exec_beside_fork_server(argv: Sequence[str], commands: Mapping[str, str],
                            wait: float | None = None) -> None:
    """A container's entrypoint, or a site's (``pflower-supernode``): start a fork server for
    ``commands`` in the background, then become ``argv`` (e.g. ``flower-superexec ...``)
    with their shims first on its ``PATH`` (never returns). With ``wait`` None, ``argv``
    does not wait for the server's imports: until the server listens, a shim runs the real
    command. With ``wait`` seconds, ``argv`` starts once the server is ready, and a server
    that is not ready by then raises RuntimeError (its last log line), ``argv`` not started.
    The server keeps the environment, and when ``argv``'s process is gone (it holds the
    server's stdin) stops what it forked, removes its folder and exits."""
    folder = private_folder()
    bin_dir = folder / "bin"
    write_shims(bin_dir, commands)
    socket_path = folder / "socket"
    read_end, write_end = os.pipe()
    log = folder / "forkserver.log"
    with log.open("wb") as errors:
        server = subprocess.Popen(
            server_command(socket_path, commands), stdin=read_end,
            stdout=subprocess.DEVNULL if wait is None else subprocess.PIPE, stderr=errors,
            start_new_session=wait is None)
    os.close(read_end)
    if wait is not None:
        ready = server.stdout.read(len(READY)) if readable(server.stdout, wait) else b""
        server.stdout.close()
        if ready != READY:
            os.close(write_end)  # the server stops: its launcher is gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(5)
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"the fork server did not start ({' '.join(tail) or 'no output'})")
    os.set_inheritable(write_end, True)
    env = {**os.environ, SOCKET_ENV: str(socket_path),
           "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", os.defpath)])}
    os.execvpe(argv[0], list(argv), env)


def readable(pipe: object, timeout: float) -> bool:
    return bool(select.select([pipe], [], [], timeout)[0])


def serve(socket_path: str, commands: Mapping[str, str]) -> None:
    """The fork server: import ``PRELOAD`` and each command's entry point, then fork a child
    for each request, in one thread (no lock another thread holds can be copied into a
    child). Once it has said it is ready, the server's folder is its own: it removes it as
    it stops. Until its launcher is gone (its stdin closes): it stops its children, then
    exits (status 0). Or until SIGTERM, SIGINT or SIGHUP: it ends by that signal, its
    children left to their shims."""
    import importlib

    # Never a CUDA call here (torch.cuda.*, a tensor on a GPU): a forked child cannot use a
    # CUDA context its parent created. Each child initialises CUDA itself, lazily, when its
    # app first puts something on a GPU. The app itself is never imported here either: each
    # child imports the app version its SuperNode installed for its run.
    for module in PRELOAD:
        if module == "ray" and "flwr-simulation" not in commands:
            continue  # a site's ClientApps never start Ray
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    entries = {}
    for command, target in commands.items():
        module, _, function = target.partition(":")
        entries[command] = getattr(importlib.import_module(module), function)
    import torch

    default_threads = torch.get_num_threads()
    # what a new process's path would hold besides its script's folder and PYTHONPATH (both
    # absolute)
    base_path = [p for p in sys.path if p not in forkchild.pythonpath(os.environ)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    # a stop signal only wakes the loop (the handler runs between two of its steps)
    wake_read, wake_write = socket.socketpair()
    for end in (wake_read, wake_write):
        end.setblocking(False)
    stop_signals: list[int] = []
    for number in STOP_SIGNALS:
        handler = signal.getsignal(number)
        if handler in (signal.SIG_IGN, None):  # ignored (SIGHUP under nohup), or not Python's
            continue
        _original_handlers[number] = handler
        signal.signal(number, lambda received, _: stop_signals.append(received))
    signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    try:
        while not stop_signals:
            for key, _ in selector.select():
                if key.fileobj is sys.stdin:  # the launcher is gone: so is what it asked for
                    listener.close()
                    _stop_children(selector)
                    return
                if key.fileobj is wake_read:
                    with contextlib.suppress(OSError):
                        wake_read.recv(64)
                elif key.fileobj is listener:
                    _fork_for(listener, selector, entries, base_path, default_threads)
                else:  # a child exited: tell its shim how
                    _reap(selector, key)
    finally:
        _remove_folder(Path(socket_path))
    number = stop_signals[0]  # end by it, as without a handler
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def _reap(selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
    """A child has exited (its pidfd is readable): tell its shim how."""
    pid, connection = key.data
    selector.unregister(key.fileobj)
    os.close(key.fileobj)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        connection.send(str(os.waitstatus_to_exitcode(status)).encode())
    connection.close()


def _stop_children(selector: selectors.BaseSelector) -> None:
    """Stop every child still running: SIGTERM, and SIGKILL to those still there after
    ``STOP_GRACE_SECONDS``. Each is reaped and its shim told how it ended. (Not reaped yet,
    a child's pid cannot have been reused.)"""
    children = {key.fileobj: key for key in selector.get_map().values() if key.data}
    for number, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, None)):
        for key in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(key.data[0], number)
        deadline = None if wait is None else time.monotonic() + wait
        while children and (deadline is None or time.monotonic() < deadline):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            for pidfd in select.select(list(children), [], [], left)[0]:
                _reap(selector, children.pop(pidfd))


def _remove_folder(socket_path: Path) -> None:
    """Remove the server's socket, and its folder where that is a private folder (its
    shims, its log)."""
    folder = socket_path.parent
    if folder.name.startswith(FOLDER_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            socket_path.unlink()


def _fork_for(listener: socket.socket, selector: selectors.BaseSelector,
              entries: Mapping[str, Callable[[], object]], base_path: list[str],
              default_threads: int) -> None:
    """Take one request and fork its child; a request that cannot be served (malformed,
    its shim already gone, no process to be had) is dropped, and the server goes on."""
    connection, _ = listener.accept()
    fds: list[int] = []
    watched = False  # then the connection is closed when its child exits
    try:
        data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        request = json.loads(data)
        entry = entries[request["command"]]
        network = forkchild.network_to_join(connection)
        # blocked across the fork: a signal sent to the child before it has its own
        # dispositions back is not taken by the server's handler
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    forkchild.close_inherited(selector, _original_handlers, mask)
                    forkchild.run_child(entry, request, fds, connection, network,
                                        base_path, default_threads)
                finally:
                    os._exit(1)  # never back into the server's loop
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # watched before the shim hears of it: a child is reaped even if its shim is gone
        selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, connection))
        watched = True
        connection.send(str(pid).encode())
    except (OSError, ValueError, KeyError, TypeError):
        if not watched:
            connection.close()
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)



if __name__ == "__main__":
    if sys.argv[1] == "--exec":
        exec_beside_fork_server(sys.argv[2:], COMMANDS)
    serve(sys.argv[1], json.loads(sys.argv[2]))
    sys.stderr.flush()
    os._exit(0)  # without tearing down PyTorch, Flower and the rest (about 0.6 s)
