"""One engine process and the two ZMQ sockets the server talks to it through.

Requests go out on a PUSH socket, step results come back on a PULL socket, msgpack-encoded; this process
never imports torch. When the engine process dies the whole thing is closed and a new one is made
(AsyncLLM does that), with fresh sockets, so nothing of the dead process's traffic can reach the new one.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from kvserve.config import EngineConfig
from kvserve.engine.core_process import (
    AbortRequest,
    AddRequest,
    FromEngine,
    Shutdown,
    encoder,
    from_engine_decoder,
    run_engine_core_process,
)


class EngineProcess:
    def __init__(self, config: EngineConfig, deliver: Callable[[FromEngine], None]) -> None:
        import zmq
        import zmq.asyncio

        self._ipc_dir = tempfile.mkdtemp(prefix="kvserve-")
        in_addr, out_addr = f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_engine_core_process, name="kvserve-engine",
                                args=(config, in_addr, out_addr, os.getpid()), daemon=True)
        self.proc.start()
        self.pid = self.proc.pid
        self._receiver = asyncio.create_task(self._receive(deliver))

    async def _receive(self, deliver: Callable[[FromEngine], None]) -> None:
        while True:
            frame = await self._pull.recv(copy=False)
            deliver(from_engine_decoder.decode(frame.buffer))

    def send(self, msg: AddRequest | AbortRequest | Shutdown) -> None:
        self._push.send(encoder.encode(msg))  # non-blocking: PUSH queues while the peer is busy

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    async def stop(self, timeout_s: float) -> None:
        """Ask the engine to exit; terminate it if it has not within timeout_s. Then close: also when the wait is
        cancelled (a shutdown while a restart was stopping a failed engine had left the sockets open, and the
        garbage collector's zmq Context.term() later blocked whatever thread it ran on, for good)."""
        try:
            if self.proc.is_alive():
                try:
                    self.send(Shutdown())
                except Exception:  # noqa: BLE001 - best effort; terminated below anyway
                    pass
                deadline = time.monotonic() + timeout_s
                while self.proc.is_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
            self.close()

    def close(self) -> None:
        """Release the sockets and the IPC files (the process must be gone or going)."""
        self._receiver.cancel()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if not self.proc.is_alive():
            self.proc.join(0)  # reap it
