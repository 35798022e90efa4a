"""The OpenAI-compatible HTTP server: FastAPI routes, admission middleware, lifecycle and graceful SIGTERM.

Requests go through a registry of served models (kvserve/gateway): each model has its tokenizer, an admission
queue, and one engine client (AsyncLLM) per replica, an engine process each by default; so this process
only parses requests, tokenizes, routes and streams, and never imports torch in that mode. One model with
one replica (`kvserve serve [MODEL]`) is the smallest such registry, not a separate path."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.config import EngineConfig
from kvserve.entrypoints.async_llm import EngineMode, EngineStartupError
from kvserve.entrypoints.openai.auth import bearer_token, key_matches
from kvserve.entrypoints.openai.errors import (
    SHUTDOWN_RETRY_AFTER, OpenAIError, bad_request, error_body, install_error_handlers)
from kvserve.entrypoints.openai.pacing import LoopPacer
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.entrypoints.openai.serving_chat import OpenAIServingChat, last_user_text
from kvserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from kvserve.entrypoints.web.routes import add_api_routes, add_page_routes
from kvserve.gateway.auto_route import AutoRouter
from kvserve.gateway.config import AUTO_MODEL, AdmissionConfig, ModelEntry, ModelsConfig
from kvserve.gateway.registry import ModelRegistry
from kvserve.metrics.dashboard import MetricsHistory
from kvserve.metrics.prometheus import MetricFamilies, ServerMetrics
from kvserve.metrics.stat_logger import log_stats_periodically
from kvserve.models.default import served_name

logger = logging.getLogger("kvserve.server")

VERSION = "0.1.0"
# New /v1 requests that start their parsing and tokenizing per event-loop turn (see openai/pacing.py).
REQUESTS_PER_LOOP_TURN = 16
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What a request that arrives while the server drains is answered with (a 503), and /health's reason then.
DRAINING_MESSAGE = "server is shutting down"
# What a request still in flight when shutdown's grace period ends is answered with (a 503).
STOPPED_MESSAGE = "the server is shutting down and stopped this request before it finished"
STOP_FLUSH_S = 5.0   # how long stopped requests get to send their 503s before the server goes on shutting down


@dataclass
class ServerArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)   # any of them is accepted; none: no auth
    cache_salt_by_api_key: bool = False  # each key gets its own prefix-cache entries (see openai/auth.py)
    served_model_names: list[str] = field(default_factory=list)
    engine_mode: EngineMode = "process"
    max_request_body_bytes: int = 16 * 2**20
    shutdown_grace_s: float = 30.0
    log_stats_interval_s: float = 5.0
    log_level: str = "info"
    web: bool = True                # the chat + dashboard page at /
    # CORS: origins whose browser pages may call the API ("*": any, vLLM's default; none: no CORS headers).
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    # Several models and/or replicas (--models-config, or `kvserve serve A B`); None: the one model of
    # `engine`, named by served_model_names. `engine` is then the base every entry's options override.
    models: ModelsConfig | None = None

    def model_names(self) -> list[str]:
        if self.models is not None:
            return self.models.model_names()
        if self.served_model_names:
            return self.served_model_names
        return [served_name(self.engine.model)]

    def models_config(self) -> ModelsConfig:
        if self.models is not None:
            return self.models
        # One model, one replica, admission as --max-waiting says (unbounded without it).
        name = self.model_names()[0]
        return ModelsConfig(models=[ModelEntry(name=name, model=self.engine.model)],  # type: ignore[arg-type]
                            admission=AdmissionConfig(max_waiting=self.engine.max_waiting))  # type: ignore[arg-type]


@dataclass
class ServerState:
    draining: bool = False
    in_flight: int = 0          # /v1 and tokenize requests still being answered (streams included)
    startup_error: str | None = None  # why an engine could not start (what the server exits with)
    # Ends every request still in flight with a 503 (set by build_app; called when draining runs out).
    stop_requests: Callable[[str], None] | None = None
    stopping: bool = False      # stop_requests was called: what still arrives is answered with a 503
    # Handlers of requests whose bodies are still arriving: nothing of theirs has reached a model yet, so
    # stop_requests cannot end them; they are cancelled instead, and answer 503 (see GuardMiddleware._admit).
    reading_bodies: set[asyncio.Task] = field(default_factory=set)

    def stop(self, why: str) -> None:
        """The end of draining (both backends): everything still in flight is answered with a 503 saying why."""
        self.stopping = True
        for task in list(self.reading_bodies):   # a slow upload would hold the shutdown past its grace
            task.cancel()
        if self.stop_requests is not None:
            # Also with none in flight: from now on a request reaching a model is refused there.
            self.stop_requests(why)


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnect detection pass through untouched): 503 while draining,
    401 without the API key on /v1, 413 for oversized bodies; paces bursts of new requests over loop turns;
    counts in-flight requests for draining; shortens a failed startup's message to its reason."""

    def __init__(self, app: ASGIApp, args: ServerArgs, state: ServerState) -> None:
        self.app, self.args, self.state = app, args, state
        self.pacer = LoopPacer(REQUESTS_PER_LOOP_TURN)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan_messages(send))
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        guarded = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        if not guarded:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _send_error(send, 503, DRAINING_MESSAGE, SHUTDOWN_RETRY_AFTER)
        # Counted from here (before the body is read): a request past the check above is one the drain waits
        # for and, once its grace period is over, stops.
        self.state.in_flight += 1
        try:
            await self._admit(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.args.api_keys and not key_matches(bearer_token(_header(scope, b"authorization")), self.args.api_keys):
            return await _send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                     {"WWW-Authenticate": "Bearer"})
        limit = self.args.max_request_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _send_error(send, 413, f"request body exceeds {limit} bytes")
        # Read the body here (bounded), then replay it, so a chunked upload cannot exceed the limit either.
        body = bytearray()
        more = True
        task = asyncio.current_task()
        self.state.reading_bodies.add(task)
        try:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    return await _send_error(send, 413, f"request body exceeds {limit} bytes")
        except asyncio.CancelledError:
            if not self.state.stopping:
                raise
            task.uncancel()   # cancelled by the drain, to be answered rather than cut off
            return await _send_error(send, 503, STOPPED_MESSAGE, SHUTDOWN_RETRY_AFTER)
        finally:
            self.state.reading_bodies.discard(task)
        await self.pacer.turn()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _lifespan_messages(self, send: Send) -> Send:
        """uvicorn logs a failed startup's or shutdown's message, which Starlette fills with the whole
        traceback. An engine that could not start has a one-line reason (e.g. a draft model path that does not
        exist), and the user should see just that. A forced exit (a third signal) skips the lifespan's
        shutdown event, so the loop's closing cancels the lifespan after its clean-up has run: a "failed"
        shutdown that is no failure, sent without its traceback."""
        async def send_short(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and self.state.startup_error is not None:
                message = {**message, "message": self.state.startup_error}
            elif (message["type"] == "lifespan.shutdown.failed" and self.state.draining
                  and isinstance(sys.exc_info()[1], asyncio.CancelledError)):
                # Sent from Starlette's except block: the cancellation, and nothing that failed for real.
                message = {"type": message["type"]}
            await send(message)
        return send_short


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    await JSONResponse(error_body(status, message), status_code=status, headers=headers)(
        {"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def add_cors(app: FastAPI, origins: list[str]) -> None:
    """Browser pages of these origins may call the API (a preflight OPTIONS had been a 405). Added after the guard,
    so it wraps it: a preflight carries no API key, and is answered before the key is asked for."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])


def build_app(args: ServerArgs, state: ServerState | None = None, auto_router: AutoRouter | None = None) -> FastAPI:
    """auto_router: what picks small or large for `model: "auto"` (default: PromptLengthRouter)."""
    state = state or ServerState()
    # --served-model-name's further names: only ever given for one model (the CLI refuses them with several), with
    # one replica or, as models of one entry, with --data-parallel-size or --routing-policy (they had been dropped).
    aliases = args.served_model_names[1:] or None
    registry = ModelRegistry.from_config(args.models_config(), args.engine, engine_mode=args.engine_mode,
                                         aliases=aliases, auto_router=auto_router)
    state.stop_requests = registry.stop_requests
    families = MetricFamilies()
    # One metrics feeder per engine (model, replica), all into one registry.
    engines = [(model, i, engine, ServerMetrics(model.name, replica=str(i), families=families))
               for model in registry.models for i, engine in enumerate(model.replicas)]
    for model in registry.models:
        families.gateway_queue_requests.labels(model.name).set_function(lambda q=model.queue: q.num_waiting)
    history = MetricsHistory(families.registry)
    completions = OpenAIServingCompletion(registry, args.cache_salt_by_api_key)
    chat = OpenAIServingChat(registry, args.cache_salt_by_api_key)
    several_engines = len(engines) > 1

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await registry.start()
        except EngineStartupError as e:
            state.startup_error = str(e)
            raise
        tasks = [asyncio.create_task(history.run())]
        for model, i, engine, metrics in engines:
            def set_info(info: dict[str, str], m: ServerMetrics = metrics) -> None:
                m.engine_info.info({"version": VERSION, **info})
            set_info(engine.engine_info)
            engine.ready_listeners.append(set_info)   # a replacement engine's, after a crash
            if engine.config.speculative_config is not None:
                # One per chain position (a token tree's alternatives count as its first).
                metrics.expect_speculation(engine.config.speculative_config.draft_depth)
            engine.step_listeners.append(metrics.on_step)
            engine.end_listeners.append(metrics.on_request_end)
            engine.restart_listeners.append(metrics.on_engine_restart)
            label = f"{model.name}/{i}: " if several_engines else ""
            tasks.append(asyncio.create_task(
                log_stats_periodically(lambda e=engine: e.stats, args.log_stats_interval_s, label)))
        for model in registry.models:
            logger.info("engine%s ready (%s mode, pid %s): serving %s, max_model_len=%d, %d replica%s",
                        "s" if len(model.replicas) > 1 else "", args.engine_mode,
                        ", ".join(str(r.engine_pid) for r in model.replicas), ", ".join(model.aliases),
                        model.max_model_len, len(model.replicas), "s" if len(model.replicas) > 1 else "")
        if registry.auto:
            note = registry.auto_chat_note()
            logger.info("model `auto`: %s%s", ", ".join(f"{k} -> {v}" for k, v in registry.auto.items()),
                        f"; {note}" if note else "")
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await registry.shutdown()

    app = FastAPI(title="kvserve", version=VERSION, lifespan=lifespan)
    app.state.registry, app.state.metrics, app.state.server_state = registry, families, state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, args=args, state=state)
    add_cors(app, args.allowed_origins)

    @app.get("/health")
    async def health() -> Response:
        # 503 while any model has no engine able to serve (all its replicas down or being replaced).
        if registry.dead is not None or state.draining:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(families.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=alias, root=m.name, max_model_len=m.max_model_len)
                 for m in registry.models for alias in m.aliases]
        if registry.auto:
            chosen = [registry.resolve(name) for name in registry.auto.values()]
            cards.append(ModelCard(id=AUTO_MODEL, root=AUTO_MODEL, max_model_len=min(m.max_model_len for m in chosen)))
        return cards

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:  # OpenAI's "retrieve model" (the client's models.retrieve)
        for card in model_cards():
            if card.id == model_id:
                return card
        raise OpenAIError(404, f"The model `{model_id}` does not exist.", "model")

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(req, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        m = chat.resolve(req.model, lambda: req.prompt if req.prompt is not None else last_user_text(req.messages),
                         chat=req.messages is not None)
        if req.messages is not None:
            ids = await chat.render_prompt(m, req.messages, req.add_generation_prompt)
        else:
            ids = await chat.encode(m, req.prompt, req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=m.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        if req.model == AUTO_MODEL and registry.auto:
            raise bad_request("token ids belong to one model's vocabulary: name the model, not `auto`", "model")
        m = chat.resolve(req.model)
        bad = next((t for t in req.tokens if t >= m.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {m.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=m.tokenizer.decode(req.tokens, skip_special_tokens=False))

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    add_api_routes(app, history, api_key_required=bool(args.api_keys), version=VERSION, web_page=args.web,
                   models=registry.names())
    if args.web:
        add_page_routes(app)

    return app


class _GracefulServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish (up to the grace
    period), then stop uvicorn and exit 0. When the grace period runs out, or on a second signal, the requests
    still in flight are stopped: each client gets a 503 (a stream: an error event, then [DONE]) and the engine
    frees their blocks before the server exits. A third signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float) -> None:
        super().__init__(config)
        self.state, self.grace_s = state, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_now = False

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        if self._loop is None or (self.state.draining and (self._stop_now or self.should_exit)):
            # One before startup finished, or one after the drain is over (a third, or a second while the
            # engines stop): stop now.
            self.force_exit = self.state.draining
            self.should_exit = True
            return
        if self.state.draining:
            # A signal handler must not touch the requests (it runs between any two bytecodes of the loop):
            # _drain polls this flag and stops them from the loop.
            self._stop_now = True
            return
        self.state.draining = True
        logger.info("received signal %d: draining %d in-flight requests (grace %.0fs)",
                    sig, self.state.in_flight, self.grace_s)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = self._loop.time() + self.grace_s
        while self.state.in_flight > 0 and self._loop.time() < deadline and not self._stop_now:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("%s; stopping %d requests still in flight",
                           "second signal" if self._stop_now else "grace period over", self.state.in_flight)
        self.state.stop(STOPPED_MESSAGE)
        # Their 503s (a stream's error event) are sent within a few loop turns; uvicorn would cancel what is
        # left after its own timeout, cutting the connection without a word.
        deadline = self._loop.time() + STOP_FLUSH_S
        while self.state.in_flight > 0 and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def run_server(args: ServerArgs) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit code (0 after a clean shutdown)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    state = ServerState()
    app = build_app(args, state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = _GracefulServer(config, state, args.shutdown_grace_s)
    server.run()
    return 0 if server.started else 1
