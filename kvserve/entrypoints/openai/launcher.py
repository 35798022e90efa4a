"""Start `kvserve serve` as a subprocess on a free local port and wait until it answers /health.

Used by the server tests and the design benchmark: they drive the real server over HTTP."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A port found free may be taken before the server binds it (Ray's processes, started meanwhile, take
# ephemeral ports too): a server that could not bind a port it was not given is started again on another.
BIND_ATTEMPTS = 3
_BIND_FAILURES = ("address already in use", "failed to bind")


class RemoteServer:
    def __init__(self, args: Sequence[str] = (), *, port: int | None = None, startup_timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> None:
        if "--port" in args:
            raise ValueError("RemoteServer: pass port=, not --port in args (the launcher says where it listens)")
        self.chosen_port = port is None
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="kvserve-server-", suffix=".log", delete=False)

    def __enter__(self) -> "RemoteServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                return self._start()
            except RuntimeError as e:
                if (not self.chosen_port or attempt == BIND_ATTEMPTS
                        or not any(f in str(e).lower() for f in _BIND_FAILURES)):
                    raise
            self.port = free_port()
            self.base_url = f"http://127.0.0.1:{self.port}"
            self.args[1] = str(self.port)
            self.log.seek(0)
            self.log.truncate()

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server did not become healthy in {self.startup_timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
