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
  takes them over and calls the entry point the real command calls;
- the shim forwards SIGTERM/SIGINT/SIGHUP to the child and exits as it exits (its code, or its
  signal); a child whose shim is gone (SIGKILL of its process group) is stopped; with no fork
  server reachable, the shim runs the real command;
- a shim in another network namespace (``LocalDeployment(namespaces=True)``) gets a child that
  joins it; where the server may not (not root), the shim runs the real command.

Seeds are unaffected: the app seeds what it uses from its run config; Python's and NumPy's
global generators are re-seeded from the OS in every child, and PyTorch's threads follow the
child's ``OMP_NUM_THREADS``, as in a new process. The app's SuperExec image
(``deploy/superexec.Dockerfile``) starts ``flower-superexec`` this way too
(``python -P forkserver.py --exec flower-superexec ARGS...``), so a site's ClientApps and the
ServerApp start warm in a container. This file must stay self-contained (the image copies it
alone).

A launcher's handle on a fork server of its own is ``launch/warm_start.py: ForkServer``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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
    """Where a fork server's socket and shims live: a Unix socket's path must stay short,
    so a private folder under /tmp."""
    return Path(tempfile.mkdtemp(prefix="pflower-fork-", dir="/tmp"))


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
    The server keeps the environment, and stops when ``argv``'s process is gone (it holds
    the server's stdin)."""
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
    child), until SIGTERM or until its launcher is gone (its stdin closes)."""
    import importlib
    import importlib.util

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
    # what a new process's path would hold besides its script's folder and PYTHONPATH
    base_path = [p for p in sys.path if p not in pythonpath(os.environ)]  # both absolute
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                return  # the launcher is gone; the children stop with their shims
            if key.fileobj is listener:
                _fork_for(listener, selector, entries, base_path, default_threads)
            else:  # a child exited: tell its shim how
                pid, connection = key.data
                selector.unregister(key.fileobj)
                os.close(key.fileobj)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    connection.send(str(os.waitstatus_to_exitcode(status)).encode())
                connection.close()


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
        network = _network_to_join(connection)
        pid = os.fork()
        if pid == 0:
            _close_inherited(selector)
            _run_child(entry, request, fds, connection, network, base_path, default_threads)
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


def _close_inherited(selector: selectors.BaseSelector) -> None:
    """In a child: close the server's listener, pidfds and other shims' connections (its
    own is not registered yet: it stays open, to watch its shim through)."""
    for key in list(selector.get_map().values()):
        if key.fileobj is sys.stdin:
            continue
        if key.data:
            key.data[1].close()
            os.close(key.fileobj)
        else:
            key.fileobj.close()
    selector.close()


def _network_to_join(connection: socket.socket) -> str | None:
    """The network namespace of the shim at the other end, where it is not the server's
    (``/proc/<pid>/ns/net``); OSError (the request is refused) where only root could join
    it."""
    pid, _, _ = struct.unpack("3i", connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    theirs = f"/proc/{pid}/ns/net"
    if os.stat(theirs).st_ino == os.stat("/proc/self/ns/net").st_ino:
        return None
    if os.geteuid() != 0:
        raise PermissionError("joining another network namespace needs root")
    return theirs


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


def _run_child(entry: Callable[[], object], request: dict, fds: list[int],
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


def pythonpath(env: Mapping[str, str]) -> list[str]:
    """PYTHONPATH's folders, made absolute as Python makes them in ``sys.path`` at start."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _name_process(name: str) -> None:
    """The child's process name (``ps``, ``pgrep``): the command's, not the server's."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


if __name__ == "__main__":
    if sys.argv[1] == "--exec":
        exec_beside_fork_server(sys.argv[2:], COMMANDS)
    serve(sys.argv[1], json.loads(sys.argv[2]))
