"""The Ray Serve ingress: the one HTTP surface (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, `/tokenize`, `/detokenize`) in front of every model's deployment.

It reads the body only to find `model`, then forwards the request unchanged to that model's deployment
through a streaming DeploymentHandle and passes the replica's status, headers and body chunks back as
they come (SSE included). Ray Serve's router picks the replica; requests beyond what the replicas take
wait in that router's queue, which is part of the queue depth the autoscaler sees (autoscaling.py).
API keys and the body limit are checked here, by the single-engine server's own middleware."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvserve.entrypoints.openai.api_server import (
    DRAINING_MESSAGE, VERSION, GuardMiddleware, ServerArgs, ServerState, add_cors)
from kvserve.entrypoints.openai.errors import (
    SHUTDOWN_RETRY_AFTER, OpenAIError, error_response, install_error_handlers)
from kvserve.entrypoints.openai.serving_base import sse_error
from kvserve.serve_ray.forwarding import ForwardedRequest

logger = logging.getLogger("kvserve.serve_ray")

_HEALTHY = {"HEALTHY", "UPSCALING", "DOWNSCALING"}   # deployment states that serve requests
_HOP_BY_HOP = {b"host", b"connection", b"transfer-encoding", b"keep-alive"}


class ModelRouter:
    """Model name -> that model's deployment handle; forwards one HTTP request to it."""

    def __init__(self, handles: dict, deployments: dict[str, str], app_name: str,
                 aliases: dict[str, str] | None = None) -> None:
        self.handles = handles              # {model name: DeploymentHandle of its ModelReplica deployment}
        self.deployments = deployments      # {model name: deployment name}, for /health
        self.app_name = app_name
        self.names = list(handles)
        self.aliases = aliases or {}        # {further --served-model-name: the model's name}; its replicas know them
        self._cards: dict[str, dict] = {}
        self.stopping: str | None = None    # why requests in flight were stopped (shutdown), once they were
        # Replica calls in flight (streaming handle responses); weak, as a response whose body is never read
        # (the client left first) never reaches the clean-up that would remove it.
        self._calls: weakref.WeakSet = weakref.WeakSet()

    def pick(self, body: bytes) -> str:
        """The model a request body names. A body that is not a JSON object, or has no usable `model`,
        goes to the first model, whose app then answers it exactly as the single-engine server would
        (400 for malformed JSON, the default model when `model` is left out)."""
        try:
            data = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            return self.names[0]
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, str) or model == "":
            return self.names[0]
        model = self.aliases.get(model, model)
        if model not in self.handles:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return model

    async def forward(self, raw: Request) -> Response:
        body = await raw.body()
        if self.stopping is not None:   # it got past the draining check just before the requests were stopped
            return error_response(503, self.stopping, headers=SHUTDOWN_RETRY_AFTER)
        name = self.pick(body)
        request = ForwardedRequest(
            method=raw.method, path=raw.url.path, body=body, query_string=raw.scope.get("query_string", b""),
            headers=[(k, v) for k, v in raw.headers.raw if k.lower() not in _HOP_BY_HOP])
        gen = None
        try:
            # Routing (and Ray's max_queued_requests check) may fail in remote() itself or in the first next.
            gen = self.handles[name].options(stream=True).handle_http.remote(request)
            self._calls.add(gen)
            start = await gen.__anext__()
        except BaseException as e:
            if gen is not None:
                self._calls.discard(gen)
                with contextlib.suppress(Exception):   # cancelling a request that failed re-raises its error
                    gen.cancel()
            if self.stopping is not None and isinstance(e, Exception):
                return error_response(503, self.stopping, headers=SHUTDOWN_RETRY_AFTER)
            if isinstance(e, BackPressureError):
                return error_response(429, f"too many requests waiting for model `{name}`; retry later",
                                      headers={"Retry-After": "1"})
            if isinstance(e, (DeploymentUnavailableError, RayError, StopAsyncIteration)):
                logger.warning("model %s: forwarding failed: %r", name, e)
                return error_response(503, f"model `{name}` is not available: {type(e).__name__}",
                                      headers={"Retry-After": "2"})
            raise
        headers = start.get("headers", [])
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        response = StreamingResponse(self._body(name, gen, sse), status_code=start["status"])
        response.raw_headers = list(headers)   # the replica's own headers (content-type, length, ...)
        return response

    async def _body(self, name: str, gen, sse: bool) -> AsyncIterator[bytes]:
        """The rest of the replica's messages as body chunks. If the replica fails mid-answer, or shutdown
        stops the request, a stream ends with an SSE error event (as the single-engine server's do); a plain
        body just ends. Leaving early (the client went away) cancels the replica's call, which aborts its
        requests."""
        finished = False
        try:
            async for msg in gen:
                if msg["type"] == "http.response.body":
                    yield msg.get("body", b"")
            finished = True
        except Exception as e:  # noqa: BLE001 - reported in the stream; the status line is already sent
            finished = True
            if self.stopping is None:
                logger.warning("model %s: replica failed mid-response: %r", name, e)
            if sse:
                message = self.stopping or f"model `{name}`: the replica serving this request failed"
                yield sse_error(OpenAIError(503, message)).encode()
                yield b"data: [DONE]\n\n"
        finally:
            self._calls.discard(gen)
            if not finished:
                with contextlib.suppress(Exception):
                    gen.cancel()

    def stop_requests(self, why: str) -> None:
        """Shutdown, after the grace period: cancel every replica call in flight (aborting its requests in the
        engine); each client gets a 503 with `why` (a stream: an error event, then [DONE])."""
        self.stopping = why
        for gen in list(self._calls):
            with contextlib.suppress(Exception):
                gen.cancel()

    async def model_cards(self) -> list[dict]:
        missing = [n for n in self.names if n not in self._cards]
        if missing:
            cards = await asyncio.gather(*(self.handles[n].model_card.remote() for n in missing))
            self._cards.update(zip(missing, cards))
        return [self._cards[n] for n in self.names] + [{**self._cards[name], "id": alias}
                                                       for alias, name in self.aliases.items()]

    async def unhealthy(self) -> str | None:
        """Why some model cannot serve, or None. From Ray Serve's deployment states, so that /health
        answers at once under load instead of queueing behind the requests."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        if app is None:
            return "application not deployed"
        for name, deployment in self.deployments.items():
            d = app.deployments.get(deployment)
            if d is None or d.status not in _HEALTHY:
                return f"model {name}: {d.status if d else 'missing'}"
        return None


def build_ingress_app(router: ModelRouter, args: ServerArgs, state: ServerState) -> FastAPI:
    app = FastAPI(title="kvserve (Ray Serve)", version=VERSION)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, args=args, state=state)
    add_cors(app, args.allowed_origins)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:   # as `kvserve serve`: a load balancer stops sending requests here
            return error_response(503, DRAINING_MESSAGE)
        why = await router.unhealthy()
        return Response(status_code=200) if why is None else error_response(503, why)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": await router.model_cards()})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:  # OpenAI's "retrieve model", as `kvserve serve`
        for card in await router.model_cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        raise OpenAIError(404, f"The model `{model_id}` does not exist.", "model")

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, router.forward, methods=["POST"], include_in_schema=False)
    return app


@serve.ingress()
class OpenAIIngress:
    """The ingress deployment: one ModelRouter, its FastAPI app built on the replica. The driver drains it on
    SIGTERM through the methods below (app.py's drain_ingress) before Ray Serve shuts down, since Serve's
    shutdown stops the HTTP proxy at once, cutting every open response."""

    def __init__(self, handles: dict, deployments: dict[str, str], app_name: str, args: ServerArgs) -> None:
        names = args.served_model_names  # several only for one model (the CLI refuses them with more)
        self.router = ModelRouter(handles, deployments, app_name, {alias: names[0] for alias in names[1:]})
        self.args = args
        self.state = ServerState(stop_requests=self.router.stop_requests)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.router, self.args, self.state)

    async def begin_drain(self) -> None:
        """New requests get 503 from now on; those in flight go on."""
        self.state.draining = True

    async def wait_idle(self, timeout_s: float) -> int:
        """Waits up to timeout_s for the requests in flight to end; returns how many are left."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.state.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.state.in_flight

    async def stop_requests(self, why: str) -> None:
        self.state.stop(why)   # as the local server's drain: uploads still arriving too, not only the replicas' calls
