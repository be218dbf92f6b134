"""A launcher's own fork server (``launch/forkserver.py``): started with its shims, stopped
with every child it forked.

    with ForkServer() as forks, LocalFederation(forkserver=forks) as federation: ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from launch.forkchild import pythonpath
from launch.forkserver import (
    COMMANDS,
    IMPORT_TIME_ENV,
    READY,
    SOCKET_ENV,
    START_TIMEOUT_SECONDS,
    private_folder,
    readable,
    server_command,
    write_shims,
)
from launch.processes import stop_process_groups


class ForkServer:
    """A fork server for ``commands`` (name: ``module:function``, default ``COMMANDS``;
    ``import_path``: where to import other ones from) and their shims in ``bin_dir``
    (context manager); stopped, with every child it forked, on exit."""

    def __init__(self, commands: Mapping[str, str] | None = None,
                 import_path: Sequence[str | Path] = ()) -> None:
        self.commands = dict(COMMANDS if commands is None else commands)
        # folders the server imports commands from (not passed on to its children)
        self.import_path = [str(Path(folder).resolve()) for folder in import_path]
        self.folder = private_folder()
        self.socket_path = self.folder / "socket"
        self.bin_dir = self.folder / "bin"
        self.log = self.folder / "forkserver.log"
        self.process: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """What a launcher adds to the environment of the processes that start COMMANDS:
        the socket, and ``bin_dir`` as the ``PATH`` entry to put first."""
        return {SOCKET_ENV: str(self.socket_path), "PATH": str(self.bin_dir)}

    def __enter__(self) -> ForkServer:
        write_shims(self.bin_dir, self.commands)
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        env.update(IMPORT_TIME_ENV)
        env["PYTHONPATH"] = os.pathsep.join([*self.import_path, *pythonpath(env)])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                server_command(self.socket_path, self.commands), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        ready = self.process.stdout.read(len(READY)) if readable(
            self.process.stdout, START_TIMEOUT_SECONDS) else b""
        if ready != READY:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)  # a server that failed is exiting: its log complete
            # read before __exit__, which removes the log with the folder
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
            self.__exit__(None, None, None)
            raise RuntimeError(f"the fork server did not start: {' '.join(tail) or 'no output'}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process_groups(self.process, 10)  # the server and any child still running
            for pipe in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
        shutil.rmtree(self.folder, ignore_errors=True)
