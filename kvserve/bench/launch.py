"""Start a server for a sweep and stop it afterwards, so only the server under test uses the CPUs."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class LaunchedServer:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        # The server was started in its own session: signal its process group (workers included),
        # which holds only what this process launched.
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll until GET /health or /v1/models answers 200. Both, because servers differ: llama-server
    answers 503 on /health while loading; transformers serve's /v1/models scans the Hub cache and
    fails offline, but its /health works."""
    base = base_url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready")
        for path in ("/health", "/v1/models"):
            try:
                r = httpx.get(base + path, timeout=5.0, trust_env=False)
                if r.status_code == 200:
                    return
                last = f"{path}: HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{path}: {e}"
        time.sleep(1.0)
    raise TimeoutError(f"{base} not ready after {timeout_s:.0f}s ({last})")


def already_serving(base_url: str) -> bool:
    """Whether something answers at base_url already: a launched server's readiness would then be that
    other server's (a leftover from an interrupted sweep), and the sweep would measure it instead."""
    try:
        httpx.get(base_url.rstrip("/") + "/health", timeout=2.0, trust_env=False)
        return True
    except httpx.HTTPError:
        return False


def launch(name: str, command: str, base_url: str, log_dir: Path,
           timeout_s: float = 600.0) -> LaunchedServer:
    if already_serving(base_url):
        raise RuntimeError(f"{base_url} already answers before {name!r} is launched: stop what serves there "
                           f"(or point --server {name}= at another port)")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    server = LaunchedServer(name, proc, log_path)
    try:
        wait_ready(base_url, timeout_s, proc)
    except RuntimeError as e:  # it exited: its reason is in its log
        server.stop()
        raise RuntimeError(f"{e}; its output: {log_path}") from None
    except BaseException:
        server.stop()
        raise
    return server
