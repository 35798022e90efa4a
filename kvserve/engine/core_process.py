"""The engine loop, independent of where it runs: its own process (talking ZMQ + msgpack, the default) or a
thread of the server process. The HTTP side only ever sends `AddRequest` / `AbortRequest` / `Shutdown`
and receives `Ready` once, then a `StepResult` per engine step.

Torch and the model are imported inside `EngineCore`, so importing this module (the server process does,
for the message types) stays cheap and torch-free."""
from __future__ import annotations

import logging
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import msgspec

from kvserve.config import EngineConfig
from kvserve.engine import faults
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestDelta
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvserve.engine")

# When idle, the loop wakes this often to notice that its parent died.
_IDLE_POLL_S = 0.5


# ---------------------------------------------------------------- messages

class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    vocab_size: int
    # The engine's tokenizer, so the server process tokenizes identically without loading the model.
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    pid: int
    engine_info: dict[str, str] = {}   # LLMEngine.describe(): the kvserve:engine_info metric's labels


class StartupFailed(msgspec.Struct, tag=True):
    message: str


class RequestError(msgspec.Struct):
    request_id: str
    message: str
    client_error: bool       # True: the request was invalid (HTTP 400); False: the engine failed on it


class StepResult(msgspec.Struct, tag=True):
    outputs: list[RequestDelta]   # per touched request, only what this step added (DESIGN.md §1)
    errors: list[RequestError]
    stats: EngineStats
    num_added: int           # AddRequests handled so far: lets the server count what is still in flight
    step_time: float         # seconds the step took (0 when no step ran)
    stepped: bool


ToEngine = Union[AddRequest, AbortRequest, Shutdown]
FromEngine = Union[Ready, StartupFailed, StepResult]

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)


# ---------------------------------------------------------------- the core

class EngineCore:
    """Wraps LLMEngine: applies messages, steps, and turns failures into per-request errors so that no
    single request can stop the loop."""

    def __init__(self, config: EngineConfig) -> None:
        from kvserve.engine.llm_engine import LLMEngine  # torch lives behind this import

        self.engine: LLMEngine = LLMEngine(config)
        self.num_added = 0
        self.live: set[str] = set()

    def ready(self) -> Ready:
        tok = self.engine.tokenizer
        return Ready(
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.model_config.vocab_size,
            tokenizer_json=tok.backend.to_str(),
            chat_template=tok.chat_template,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            eos_token_ids=list(tok.eos_token_ids),
            pid=os.getpid(),
            engine_info=self.engine.describe(),
        )

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def handle(self, msg: AddRequest | AbortRequest, errors: list[RequestError]) -> None:
        if isinstance(msg, AddRequest):
            self.num_added += 1
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                        priority=msg.priority, arrival_time=msg.arrival_time,
                                        cache_salt=msg.cache_salt)
                self.live.add(msg.request_id)
            except ValueError as e:
                errors.append(RequestError(msg.request_id, str(e), client_error=True))
            except Exception as e:  # noqa: BLE001 - an engine bug on one request must not stop the loop
                logger.exception("add_request %s failed", msg.request_id)
                errors.append(RequestError(msg.request_id, f"engine error: {e}", client_error=False))
        else:
            ids = [r for r in msg.request_ids if r in self.live]
            if ids:
                self.engine.abort_request(ids)
                self.live.difference_update(ids)

    def step(self, errors: list[RequestError]) -> list[RequestDelta]:
        try:
            outputs = self.engine.step_deltas()
        except Exception as e:  # noqa: BLE001
            # We cannot tell which request broke the step: fail every live one and free its blocks,
            # so the engine is clean and keeps serving new requests.
            logger.error("engine step failed; aborting %d requests:\n%s", len(self.live), traceback.format_exc())
            failed = sorted(self.live)
            try:
                self.engine.abort_request(failed)
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step also failed")
            self.live.clear()
            errors.extend(RequestError(r, f"engine error: {e}", client_error=False) for r in failed)
            return []
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        return outputs

    def stats(self) -> EngineStats:
        return self.engine.get_stats()


def run_loop(core: EngineCore, recv: Callable[[float | None], list], send: Callable[[StepResult], None],
             should_exit: Callable[[], bool] = lambda: False) -> None:
    """The busy loop. recv(timeout) returns the pending messages, waiting up to timeout seconds when there are
    none. Messages are applied between steps, so an abort takes effect before the next step: within one step
    of the disconnect. should_exit is polled every iteration (a getppid() call), so an engine whose server
    died stops even while busy instead of blocking forever on a socket nobody reads."""
    while not should_exit():
        msgs = recv(0.0 if core.has_work() else _IDLE_POLL_S)
        errors: list[RequestError] = []
        changed = bool(msgs)
        for msg in msgs:
            if isinstance(msg, Shutdown):
                return
            core.handle(msg, errors)
        outputs: list[RequestDelta] = []
        step_time = 0.0
        stepped = False
        if core.has_work():
            t0 = time.perf_counter()
            outputs = core.step(errors)
            step_time = time.perf_counter() - t0
            stepped = changed = True
        if changed:
            send(StepResult(outputs, errors, core.stats(), core.num_added, step_time, stepped))


def use_passive_openmp() -> None:
    """Let idle OpenMP threads sleep at once rather than spin: for the engine *thread* design, where the
    engine's OpenMP threads share a process and the cores with the HTTP loop, and spinning starved it
    (benchmarks/results/server_design.md). Must run before torch loads its OpenMP runtime; an explicit
    OMP_WAIT_POLICY in the environment wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---------------------------------------------------------------- process transport

def run_engine_core_process(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Entry point of the engine process (multiprocessing 'spawn' target)."""
    import zmq

    # The server process owns shutdown (it drains streams on SIGTERM, then sends Shutdown);
    # a Ctrl-C or SIGTERM delivered to the whole process group must not kill the engine under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # OpenMP keeps libgomp's default wait policy here (spin a while, then sleep): against PASSIVE it gave
    # 1.35x the generation throughput at 32 streams with /health p99 still under 10 ms
    # (benchmarks/results/server_wait_policy.md). An explicit OMP_WAIT_POLICY in the environment wins.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(output_addr)
    try:
        try:
            core = EngineCore(config)
        except Exception as e:  # noqa: BLE001 - reported to the server, which exits with the message
            push.send(encoder.encode(_startup_failed(e)))
            return
        push.send(encoder.encode(core.ready()))
        fault_token = faults.crash_token()

        def recv(timeout: float | None) -> list:
            msgs = []
            if pull.poll(int(timeout * 1000) if timeout is not None else None):
                while True:
                    try:
                        msgs.append(to_engine_decoder.decode(pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                    if isinstance(msgs[-1], AddRequest):
                        faults.maybe_crash(msgs[-1].prompt_token_ids, fault_token)
            return msgs

        def send(result: StepResult) -> None:
            push.send(encoder.encode(result), copy=False)

        run_loop(core, recv, send, should_exit=lambda: os.getppid() != parent_pid)
    finally:
        pull.close(linger=0)
        push.close(linger=1000)
        ctx.term()


def _startup_failed(e: Exception) -> StartupFailed:
    """What the server is told (it exits with the message). A configuration the engine refuses (ValueError,
    FileNotFoundError) is the user's to fix and its message says how, so it is not logged here too; anything
    else is a bug, and its traceback is logged."""
    if not isinstance(e, (ValueError, FileNotFoundError)):
        logger.exception("engine failed to start")
    return StartupFailed(f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------- thread transport

def run_engine_core_thread(core_factory: Callable[[], EngineCore], inbox: "queue.Queue[ToEngine]",
                           send: Callable[[Ready | StartupFailed | StepResult], None]) -> None:
    """Entry point of the engine thread (the in-process design, kept for the design benchmark)."""
    try:
        core = core_factory()
    except Exception as e:  # noqa: BLE001
        send(_startup_failed(e))
        return
    send(core.ready())

    def send_copy(result: StepResult) -> None:
        # The engine keeps mutating the objects it returned (metrics, logprob lists); hand the server a
        # snapshot, made the same way as in the process design.
        send(from_engine_decoder.decode(encoder.encode(result)))

    def recv(timeout: float | None) -> list:
        msgs = []
        try:
            msgs.append(inbox.get(timeout=timeout) if timeout else inbox.get_nowait())
            while True:
                msgs.append(inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    run_loop(core, recv, send_copy)
