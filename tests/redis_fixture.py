"""A real ``redis-server`` for tests: started on a free 127.0.0.1 port with its own temp dir (no
persistence), ready once it logs that it accepts connections and answers PING, killed and
restarted on the same port on demand. ``tests/conftest.py``'s ``redis_server`` fixture (module
scope) yields one; ``bench/tiers_io.py`` starts one the same way.

    with RedisServer() as s:
        store = RedisStore(s.url)
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Optional

__all__ = ["RedisServer", "redis_server_binary"]

_READY = b"Ready to accept connections"


def redis_server_binary() -> Optional[str]:
    """The ``redis-server`` on PATH (or /usr/bin, /usr/sbin), or None."""
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin:/usr/local/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process (``--port P --dir D --save '' --appendonly no``).

    Args:
        port: the port (None: a free one).
        extra: more ``redis-server`` arguments (``["--maxmemory", "1mb"]``).
        ready_timeout: seconds to wait for it to accept connections.

    Attributes:
        port, url (``redis://127.0.0.1:P/0``), dir.
    """

    def __init__(self, port: Optional[int] = None, extra: tuple[str, ...] = (), ready_timeout: float = 30.0) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server not found (.ci/setup installs Debian's redis-server package)")
        self.binary, self.extra, self.ready_timeout = binary, tuple(extra), ready_timeout
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="radixkv-redis-")
        self.proc: Optional[subprocess.Popen] = None
        self._drainer: Optional[threading.Thread] = None
        self.log = bytearray()
        self.start()

    def start(self) -> None:
        """Start the server (on the same port again after :meth:`kill`) and wait until it is ready.
        A port another process took meanwhile (it is free while the server is down) is tried again
        until ``ready_timeout``: the URL stays the same.

        Raises:
            RuntimeError: it exited or did not become ready within ``ready_timeout`` (its log).
        """
        assert self.proc is None, "already running"
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                return self._start()
            except RuntimeError:
                if b"Address already in use" not in self.log or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)  # NOTE: nothing tells when another process lets go of a port

    def _start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir]
        args += ["--save", "", "--appendonly", "no", "--logfile", "", "--daemonize", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.log.clear()
        self._wait_ready()
        self._drainer = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._drainer.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        fd = self.proc.stdout.fileno()
        while _READY not in self.log:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                self.kill()
                raise RuntimeError(
                    f"redis-server did not start on port {self.port}: {self.log.decode(errors='replace')}"
                )
            self.log += chunk
        if not _ping(self.port, timeout=self.ready_timeout):
            self.kill()
            raise RuntimeError(f"redis-server on port {self.port} does not answer PING")

    @staticmethod
    def _drain(proc: subprocess.Popen) -> None:
        # NOTE: keeps the log pipe empty so that the server never blocks writing to it.
        with proc.stdout:
            for _ in iter(lambda: proc.stdout.read1(65536), b""):
                pass

    def kill(self) -> None:
        """SIGKILL the server (a crash: connections drop, nothing is saved) and reap it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self._drainer is None:
                self.proc.stdout.close()
            else:
                self._drainer.join(timeout=30)  # the pipe's EOF follows the process's death
                self._drainer = None
            self.proc = None

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
