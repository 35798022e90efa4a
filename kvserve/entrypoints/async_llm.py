"""The server's handle on the engine: submit a request, iterate its deltas, abort it; keep an engine running.

Two transports behind one class (see benchmarks/server_design.py for why "process" is the default):
  - "process": the engine runs in its own process (kvserve.entrypoints.engine_process); requests go over a ZMQ
    PUSH socket, results come back on a PULL socket, msgpack-encoded. This process never imports torch.
    If that process dies (kill -9, the OOM killer, a crash in a kernel), the requests in flight fail at once
    (503; streams end with an SSE error event), /health answers 503, and a new engine process is started;
    /health is 200 again once it is ready. Requests are never resubmitted by the server, and one that keeps
    crashing the engine is refused (kvserve.entrypoints.crash_quarantine).
  - "thread": the engine runs in a thread of this process; messages pass through queues.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer as BackendTokenizer

from kvserve.config import EngineConfig
from kvserve.engine.core_process import (
    AbortRequest,
    AddRequest,
    EngineCore,
    FromEngine,
    Ready,
    Shutdown,
    StartupFailed,
    StepResult,
    run_engine_core_thread,
    use_passive_openmp,
)
from kvserve.engine.stats import EngineStats
from kvserve.entrypoints.crash_quarantine import CrashQuarantine, request_fingerprint
from kvserve.entrypoints.engine_process import EngineProcess
from kvserve.outputs import RequestDelta
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.server")

EngineMode = Literal["process", "thread"]

# How often the server checks that the engine process is alive: /health turns 503 within this (plus a
# request's own latency) of a death.
_WATCH_INTERVAL_S = 0.1
# A dead engine is replaced at once; if engines keep dying (crashes within _CRASH_WINDOW_S of each other),
# each replacement waits longer, doubling up to _MAX_BACKOFF_S, so a crash loop does not spin the CPU.
_CRASH_WINDOW_S = 300.0
_MAX_BACKOFF_S = 30.0
# A step touches up to max_num_seqs streams. Woken all at once, they would each format and send a chunk in
# one turn of the event loop (hundreds of chunks, tens of ms) before it polls its sockets again, and /health
# and new requests would wait behind them. They are woken this many per turn instead.
_DELIVERY_SLICE = 16


class EngineRequestError(Exception):
    """The engine rejected (client_error) or failed on one request."""

    def __init__(self, message: str, client_error: bool) -> None:
        super().__init__(message)
        self.client_error = client_error


class EngineDeadError(Exception):
    pass


class EngineStartupError(RuntimeError):
    """The engine could not start: its message says why (a bad configuration says what to change)."""


class EngineOverloadedError(Exception):
    """More than config.max_waiting requests would be waiting."""


class ServerStopping(Exception):
    """The server is shutting down and stopped this request before it finished (see stop_requests)."""


@dataclass
class _Stream:
    fingerprint: bytes | None       # for the crash quarantine (process mode only)
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
        self.engine_info: dict[str, str] = {}  # LLMEngine.describe(), once ready
        self.stats = EngineStats()
        self.step_listeners: list[StepListener] = []
        # Called with the engine's id of the request (see generate) when its stream ends.
        self.end_listeners: list[Callable[[str], None]] = []
        self.restart_listeners: list[Callable[[], None]] = []  # called when a replacement engine is started
        # Called with engine_info whenever an engine is ready, a replacement too (its pool may differ).
        self.ready_listeners: list[Callable[[dict[str, str]], None]] = []
        self.dead: str | None = None          # why no engine is serving (gone, or being replaced), if so
        self.stopping: str | None = None      # why new requests are refused: the server is shutting down
        self.num_restarts = 0                 # engine processes started to replace one that died
        self.quarantine = CrashQuarantine()
        self._streams: dict[str, _Stream] = {}          # by the engine's request id
        self._client_ids: set[str] = set()               # the callers' request ids of those streams
        self._submissions = itertools.count()
        # Step outputs not yet handed to their streams, in arrival order (see _DELIVERY_SLICE).
        self._outbox: deque[tuple[_Stream, RequestDelta | Exception]] = deque()
        self._delivering = False
        self._num_sent = 0                     # AddRequests sent; the engine reports how many it handled
        self._num_handled = 0
        self._send: Callable[[AddRequest | AbortRequest | Shutdown], None] | None = None
        self._engine: EngineProcess | None = None
        self._watcher: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._crash_times: deque[float] = deque()

    # ------------------------------------------------------------ lifecycle

    async def start(self, startup_timeout_s: float = 600.0) -> None:
        if self.mode == "process":
            await self._launch(startup_timeout_s)
            self._watcher = asyncio.create_task(self._watch())
            return
        loop = asyncio.get_running_loop()
        first: asyncio.Future = loop.create_future()
        self._start_thread(loop, self._deliver_to(first))
        msg = await asyncio.wait_for(first, startup_timeout_s)
        if isinstance(msg, StartupFailed):
            await self.shutdown()
            raise EngineStartupError(f"engine failed to start: {msg.message}")
        self._apply_ready(msg)

    def _deliver_to(self, first: asyncio.Future) -> Callable[[FromEngine], None]:
        def deliver(msg: FromEngine) -> None:
            if isinstance(msg, StepResult):
                self._on_step(msg)
            elif not first.done():
                first.set_result(msg)
        return deliver

    async def _launch(self, startup_timeout_s: float) -> None:
        """Start an engine process and wait for its Ready. Raises EngineStartupError if it fails or dies first."""
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        engine = EngineProcess(self.config, self._deliver_to(first))
        self._engine, self._send, self.engine_pid = engine, engine.send, engine.pid
        deadline = time.monotonic() + startup_timeout_s
        while not first.done():
            if not engine.is_alive() or time.monotonic() > deadline:
                why = (f"exited with code {engine.exitcode}" if not engine.is_alive()
                       else f"not ready after {startup_timeout_s:.0f}s")
                await self._drop_engine()
                raise EngineStartupError(f"engine process {why} while starting")
            await asyncio.wait({first}, timeout=_WATCH_INTERVAL_S)
        msg = first.result()
        if isinstance(msg, StartupFailed):
            await self._drop_engine()
            raise EngineStartupError(f"engine failed to start: {msg.message}")
        self._apply_ready(msg)

    async def _drop_engine(self) -> None:
        engine, self._engine, self._send = self._engine, None, None
        if engine is not None:
            await engine.stop(timeout_s=0.0 if not engine.is_alive() else 5.0)

    async def _watch(self) -> None:
        """Replace the engine process whenever it dies, until shutdown."""
        while not self._closing:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            engine = self._engine
            if engine is None or engine.is_alive() or self._closing:
                continue
            await self._replace_dead_engine(f"engine process (pid {engine.pid}) died with exit code "
                                            f"{engine.exitcode}")

    async def _replace_dead_engine(self, why: str) -> None:
        now = time.monotonic()
        self._crash_times.append(now)
        while self._crash_times[0] < now - _CRASH_WINDOW_S:
            self._crash_times.popleft()
        self.quarantine.note_crash(s.fingerprint for s in self._streams.values() if s.fingerprint is not None)
        self._mark_dead(f"{why}; a new engine process is starting")
        await self._drop_engine()
        self._num_sent = self._num_handled = 0
        self.stats = EngineStats()
        attempt = 0
        while not self._closing:
            # The first replacement starts at once; engines that keep dying wait longer each time.
            backoff = min(_MAX_BACKOFF_S, 0.5 * 2 ** (len(self._crash_times) + attempt - 2))
            if len(self._crash_times) + attempt > 1:
                logger.warning("engine died %d times in %.0fs; waiting %.1fs before the next start",
                               len(self._crash_times), _CRASH_WINDOW_S, backoff)
                await asyncio.sleep(backoff)
            self.num_restarts += 1
            for listener in self.restart_listeners:
                listener()
            try:
                await self._launch(600.0)
            except RuntimeError as e:
                attempt += 1
                logger.error("engine restart failed: %s", e)
                continue
            self.dead = None
            logger.warning("engine restarted (pid %s, restart %d) after: %s", self.engine_pid, self.num_restarts, why)
            return

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
        self.engine_info = ready.engine_info
        for listener in self.ready_listeners:
            listener(ready.engine_info)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        if self._watcher is not None:
            watcher, self._watcher = self._watcher, None
            watcher.cancel()
            # Its clean-up (an engine it was starting or stopping) runs before the engine below is stopped.
            await asyncio.gather(watcher, return_exceptions=True)
        if self._engine is not None:
            engine, self._engine, self._send = self._engine, None, None
            await engine.stop(timeout_s)
        if self._thread is not None:
            if self._send is not None and self.dead is None:
                self._send(Shutdown())
            self._thread.join(timeout_s)

    def _mark_dead(self, why: str) -> None:
        self.dead = why
        logger.error("%s", why)
        self._deliver(len(self._outbox))  # what the engine sent before dying goes first, then the error
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(why))
        self._streams.clear()  # their generators end on the error; nothing of theirs is in the next engine

    def stop_requests(self, why: str) -> None:
        """Shutdown, once the grace period is over: abort every request in the engine (freeing its blocks) and
        end each stream with ServerStopping(why) after what was already received, so every client is told
        rather than cut off; later requests are refused the same way."""
        self.stopping = why
        self._deliver(len(self._outbox))
        if self._streams and self._send is not None and self.dead is None:
            self._send(AbortRequest(list(self._streams)))
        for stream in self._streams.values():
            stream.queue.put_nowait(ServerStopping(why))
        self._streams.clear()  # their generators end on the error without aborting again

    # ------------------------------------------------------------ requests

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: its waiting queue plus what it has not received yet."""
        return self.stats.num_waiting + max(0, self._num_sent - self._num_handled)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestDelta]:
        """Yields the request's deltas (what each step added) until it finishes. Leaving early (the client went
        away, the task was cancelled) aborts the request in the engine, which frees its KV blocks before its
        next step. arrival_time (time.monotonic(), the same clock in every process): when the request
        arrived, if before now (it waited in a gateway queue); the engine's latency metrics count from it."""
        if self.stopping is not None:
            raise ServerStopping(self.stopping)
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        fingerprint = None
        if self.mode == "process":
            fingerprint = request_fingerprint(prompt_token_ids, params, cache_salt)
            crashes = self.quarantine.crashes(fingerprint)
            if crashes >= self.quarantine.max_crashes:
                raise EngineRequestError(f"refused: the engine process died {crashes} times while this request "
                                         "(the same prompt and parameters) was running", client_error=True)
        # Checked here, right before the send with no await in between, so concurrent requests cannot all
        # pass the check before any of them is counted.
        max_waiting = self.config.max_waiting
        if max_waiting is not None and self.num_waiting + 1 > max_waiting:
            raise EngineOverloadedError(f"too many requests waiting (max_waiting={max_waiting}); retry later")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._client_ids:
            raise EngineRequestError(f"request_id {request_id!r} is already in use", client_error=True)
        # The engine knows each submission by an id of its own. A client may reuse its request_id as soon as its
        # stream ends (a retry after a timeout), while steps the engine made before it saw the abort are still
        # on their way here: keyed by the caller's id, they reached the new stream (its text began with the old
        # one's tail, and its end could come from the old one, leaving the new request running for nobody).
        engine_id = f"{request_id}#{next(self._submissions)}"
        stream = _Stream(fingerprint)
        self._streams[engine_id] = stream
        self._client_ids.add(request_id)
        finished = False
        try:
            self._send(AddRequest(engine_id, list(prompt_token_ids), params, priority,
                                  time.monotonic() if arrival_time is None else arrival_time, cache_salt))
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
            if self._streams.get(engine_id) is stream:
                del self._streams[engine_id]
            self._client_ids.discard(request_id)
            if not finished and self.dead is None:
                self._send(AbortRequest([engine_id]))
            for listener in self.end_listeners:
                listener(engine_id)

    def _deliver(self, count: int) -> None:
        for _ in range(min(count, len(self._outbox))):
            stream, item = self._outbox.popleft()
            stream.queue.put_nowait(item)

    def _deliver_slice(self) -> None:
        """Wake the next _DELIVERY_SLICE streams; the rest on the loop's next turn, after it has polled its
        sockets (a callback scheduled now runs only then). A stream's items keep their order."""
        self._deliver(_DELIVERY_SLICE)
        if self._outbox:
            asyncio.get_running_loop().call_soon(self._deliver_slice)
        else:
            self._delivering = False

    def _on_step(self, result: StepResult) -> None:
        self.stats = result.stats
        self._num_handled = result.num_added
        # Outputs of requests already aborted here (sent before the engine saw the abort) are dropped,
        # for the listeners too, so metrics count only what reached a client.
        result.outputs = [out for out in result.outputs if out.request_id in self._streams]
        for out in result.outputs:
            self._outbox.append((self._streams[out.request_id], out))
        for err in result.errors:
            stream = self._streams.get(err.request_id)
            if stream is not None:
                self._outbox.append((stream, EngineRequestError(err.message, err.client_error)))
        if self._outbox and not self._delivering:
            self._delivering = True
            self._deliver_slice()
        for listener in self.step_listeners:
            try:
                listener(result)
            except Exception:  # noqa: BLE001 - metrics must never break output delivery
                logger.exception("step listener failed")

