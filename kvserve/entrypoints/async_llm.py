"""The server's handle on the engine: submit a request, iterate its outputs, abort it.

Two transports behind one class (see benchmarks/server_design.py for why "process" is the default):
  - "process": the engine runs in its own process (kvserve.engine.core_process); requests go over a ZMQ
    PUSH socket, results come back on a PULL socket, msgpack-encoded. This process never imports torch.
  - "thread": the engine runs in a thread of this process; messages pass through queues.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer as BackendTokenizer

from kvserve.config import EngineConfig
from kvserve.engine.core_process import (
    AbortRequest,
    AddRequest,
    EngineCore,
    Ready,
    Shutdown,
    StartupFailed,
    StepResult,
    encoder,
    from_engine_decoder,
    run_engine_core_process,
    run_engine_core_thread,
    use_passive_openmp,
)
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestDelta
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.server")

EngineMode = Literal["process", "thread"]


class EngineRequestError(Exception):
    """The engine rejected (client_error) or failed on one request."""

    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error


class EngineDeadError(Exception):
    pass


class EngineOverloadedError(Exception):
    """More than config.max_waiting requests would be waiting."""


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # RequestDeltas, or the exception ending it


StepListener = Callable[[StepResult], None]


class AsyncLLM:
    def __init__(self, config: EngineConfig, mode: EngineMode = "process") -> None:
        self.config = config
        self.mode = mode
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.engine_pid: int | None = None
        self.stats = EngineStats()
        self.step_listeners: list[StepListener] = []
        self.end_listeners: list[Callable[[str], None]] = []   # called with the request id when its stream ends
        self.dead: str | None = None          # why the engine is gone, once it is
        self._streams: dict[str, _Stream] = {}
        self._num_sent = 0                     # AddRequests sent; the engine reports how many it handled
        self._num_handled = 0
        self._send: Callable[[AddRequest | AbortRequest | Shutdown], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        self._zmq_ctx = None
        self._ipc_dir: str | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self, startup_timeout_s: float = 600.0) -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future = loop.create_future()

        def deliver(msg: Ready | StartupFailed | StepResult) -> None:
            if isinstance(msg, StepResult):
                self._on_step(msg)
            elif not first.done():
                first.set_result(msg)

        if self.mode == "process":
            await self._start_process(deliver)
        else:
            self._start_thread(loop, deliver)
        msg = await asyncio.wait_for(first, startup_timeout_s)
        if isinstance(msg, StartupFailed):
            await self.shutdown()
            raise RuntimeError(f"engine failed to start: {msg.message}")
        self._apply_ready(msg)

    async def _start_process(self, deliver: Callable) -> None:
        import zmq
        import zmq.asyncio

        self._ipc_dir = tempfile.mkdtemp(prefix="kvserve-")
        in_addr = f"ipc://{self._ipc_dir}/in"
        out_addr = f"ipc://{self._ipc_dir}/out"
        self._zmq_ctx = zmq.asyncio.Context()
        push = self._zmq_ctx.socket(zmq.PUSH)
        push.bind(in_addr)
        pull = self._zmq_ctx.socket(zmq.PULL)
        pull.bind(out_addr)
        self._send = lambda m: push.send(encoder.encode(m))  # non-blocking: PUSH queues while the peer is busy

        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=run_engine_core_process, name="kvserve-engine",
                                 args=(self.config, in_addr, out_addr, os.getpid()), daemon=True)
        self._proc.start()
        self.engine_pid = self._proc.pid

        async def receive() -> None:
            while True:
                frame = await pull.recv(copy=False)
                deliver(from_engine_decoder.decode(frame.buffer))

        async def watch() -> None:
            while self._proc is not None and self._proc.is_alive():
                await asyncio.sleep(0.5)
            self._mark_dead(f"engine process exited with code {self._proc.exitcode if self._proc else None}")

        self._tasks += [asyncio.create_task(receive()), asyncio.create_task(watch())]

    def _start_thread(self, loop: asyncio.AbstractEventLoop, deliver: Callable) -> None:
        inbox: queue.Queue = queue.Queue()
        self._send = inbox.put
        use_passive_openmp()  # before the engine thread imports torch

        def send_from_thread(msg: Ready | StartupFailed | StepResult) -> None:
            try:
                loop.call_soon_threadsafe(deliver, msg)
            except RuntimeError:  # loop closed during shutdown
                pass

        self._thread = threading.Thread(
            target=run_engine_core_thread, args=(lambda: EngineCore(self.config), inbox, send_from_thread),
            name="kvserve-engine", daemon=True)
        self._thread.start()
        self.engine_pid = os.getpid()

    def _apply_ready(self, ready: Ready) -> None:
        self.tokenizer = Tokenizer(BackendTokenizer.from_str(ready.tokenizer_json), ready.chat_template,
                                   ready.bos_token, ready.eos_token, ready.eos_token_ids)
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.engine_pid = ready.pid

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._send is not None and self.dead is None:
            try:
                self._send(Shutdown())
            except Exception:  # noqa: BLE001 - best effort; the process is terminated below anyway
                pass
        if self._proc is not None:
            deadline = time.monotonic() + timeout_s
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        if self._thread is not None:
            self._thread.join(timeout_s)
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()
        if self._zmq_ctx is not None:
            self._zmq_ctx.destroy(linger=0)
            self._zmq_ctx = None
        if self._ipc_dir is not None:
            for name in ("in", "out"):
                try:
                    os.unlink(os.path.join(self._ipc_dir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self._ipc_dir)
            except OSError:
                pass
            self._ipc_dir = None
        self._proc = None

    def _mark_dead(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.error("%s", why)
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(why))

    # ------------------------------------------------------------ requests

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: its waiting queue plus what it has not received yet."""
        return self.stats.num_waiting + max(0, self._num_sent - self._num_handled)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestDelta]:
        """Yields the request's deltas (what each step added) until it finishes. Leaving early (the client went
        away, the task was cancelled) aborts the request in the engine, which frees its KV blocks before its
        next step."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # Checked here, right before the send with no await in between, so concurrent requests cannot all
        # pass the check before any of them is counted.
        max_waiting = self.config.max_waiting
        if max_waiting is not None and self.num_waiting + 1 > max_waiting:
            raise EngineOverloadedError(f"too many requests waiting (max_waiting={max_waiting}); retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise EngineRequestError(f"request_id {request_id!r} is already in use", client_error=True)
        stream = _Stream()
        self._streams[request_id] = stream
        finished = False
        try:
            self._send(AddRequest(request_id, list(prompt_token_ids), params, priority, time.monotonic(),
                                  cache_salt))
            self._num_sent += 1
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True  # the engine already dropped it
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.dead is None:
                self._send(AbortRequest([request_id]))
            for listener in self.end_listeners:
                listener(request_id)

    def _on_step(self, result: StepResult) -> None:
        self.stats = result.stats
        self._num_handled = result.num_added
        # Outputs of requests already aborted here (sent before the engine saw the abort) are dropped,
        # for the listeners too, so metrics count only what reached a client.
        result.outputs = [out for out in result.outputs if out.request_id in self._streams]
        for out in result.outputs:
            self._streams[out.request_id].queue.put_nowait(out)
        for err in result.errors:
            stream = self._streams.get(err.request_id)
            if stream is not None:
                stream.queue.put_nowait(EngineRequestError(err.message, err.client_error))
        for listener in self.step_listeners:
            try:
                listener(result)
            except Exception:  # noqa: BLE001 - metrics must never break output delivery
                logger.exception("step listener failed")

