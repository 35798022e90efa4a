"""The test servers' launcher: a port found free but taken before the server binds it (as Ray's processes
took one in a CI run) costs a restart on another port, not the tests that share the server."""
from __future__ import annotations

import socket

import httpx
import pytest

from kvserve.entrypoints.openai import launcher

pytestmark = pytest.mark.timeout(300)


def test_a_server_whose_port_was_taken_starts_again_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real())
        with launcher.RemoteServer(["--max-num-seqs", "2", "--max-model-len", "256"]) as s:
            assert s.port != busy
            assert httpx.get(s.base_url + "/health", timeout=5).status_code == 200
            assert f"--port {s.port}" in " ".join(s.args)


def test_a_server_given_its_port_is_not_moved():
    """An explicit port stays the caller's: a bind failure there is the caller's error to see."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        server = launcher.RemoteServer(["--max-num-seqs", "2", "--max-model-len", "256"], port=busy)
        with pytest.raises(RuntimeError, match="(?i)address already in use"):
            server.start()
        server.stop()
