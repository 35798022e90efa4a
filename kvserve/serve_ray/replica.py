"""One replica of one model in Ray Serve: one AsyncLLM engine client behind kvserve's own OpenAI app.

The replica does not re-implement request handling: it builds the same FastAPI app as `kvserve serve`
(kvserve.entrypoints.openai.api_server.build_app, for one model name) and runs each forwarded request
through it as an ASGI call, streaming the app's messages back to the ingress. So validation, the chat
template, tokenization, sampling parameters, SSE framing and OpenAI error JSON are the single-engine
server's, and so is the engine client (DESIGN.md §8: no second engine loop)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from kvserve.entrypoints.openai.api_server import LOG_FORMAT, ServerArgs, build_app
from kvserve.entrypoints.openai.protocol import ModelCard
from kvserve.serve_ray.autoscaling import BATCH_SLOTS_METRIC, RUNNING_METRIC, WAITING_METRIC
from kvserve.serve_ray.forwarding import REPLICA_HEADER, ForwardedRequest

logger = logging.getLogger("kvserve.serve_ray")


class ModelReplica:
    async def __init__(self, name: str, server_args: ServerArgs) -> None:
        from ray import serve

        # Ray's worker processes leave logging unconfigured (WARNING, to no handler of its own): the engine's
        # periodic stats line (acceptance included) and the messages below would be dropped.
        logging.basicConfig(format=LOG_FORMAT)
        logging.getLogger("kvserve").setLevel(server_args.log_level.upper())
        self.name = name
        self.app = build_app(server_args)
        # The app serves one model with one engine; requests beyond its batch wait in the model's own
        # admission queue (kvserve/gateway), so waiting counts both.
        self.model = self.app.state.registry.models[0]
        self.engine = self.model.replicas[0]
        # The app's lifespan starts the engine (and its stats logging) and stops it. It is held open by one
        # task, entered and left there, as an ASGI server would; __del__ lets it end.
        self._stop = asyncio.Event()
        started = asyncio.Event()

        async def hold_lifespan() -> None:
            async with self.app.router.lifespan_context(self.app):
                started.set()
                await self._stop.wait()

        self._lifespan = asyncio.create_task(hold_lifespan())
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({self._lifespan, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._lifespan.done():
            self._lifespan.result()   # the engine failed to start: raise why
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("model %s: replica %s ready (engine pid %s)", name, self.replica_id, self.engine.engine_pid)

    async def __del__(self) -> None:
        # Ray Serve calls this once in-flight requests have finished (or its graceful timeout passed), and
        # also after __init__ failed: then the lifespan task is over, its error already raised there.
        if getattr(self, "_lifespan", None) is not None and not self._lifespan.done():
            self._stop.set()
            await self._lifespan

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[dict]:
        """Yields the ASGI messages kvserve's app sends for `request`. Ray cancels this generator when the
        client goes away; the app then sees its task cancelled, which aborts the engine requests."""
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        body_given = False

        async def receive() -> dict:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # Nothing more arrives: a client that leaves cancels this whole call instead.
            await asyncio.get_running_loop().create_future()
            raise AssertionError("unreachable")

        app_task = asyncio.create_task(self.app(request.asgi_scope(), receive, messages.put))
        app_task.add_done_callback(lambda _: messages.put_nowait(None))
        complete = False
        try:
            while (msg := await messages.get()) is not None:
                if msg["type"] == "http.response.body":
                    msg = _coalesce(msg, messages)
                if msg["type"] == "http.response.start":
                    msg = {**msg, "headers": [*msg.get("headers", []),
                                              (REPLICA_HEADER.encode(), self.replica_id.encode())]}
                yield msg
                if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                    complete = True
                    break
        finally:
            if complete and not app_task.done():
                # After the last body message the app only has clean-up left; give it a moment.
                with contextlib.suppress(asyncio.TimeoutError, Exception):
                    await asyncio.wait_for(asyncio.shield(app_task), 0.5)
            if not app_task.done():
                app_task.cancel()
                await asyncio.gather(app_task, return_exceptions=True)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics hook: what QueueDepthPolicy scales on."""
        return {WAITING_METRIC: float(self.model.queue.num_waiting + self.engine.num_waiting),
                RUNNING_METRIC: float(self.engine.stats.num_running),
                BATCH_SLOTS_METRIC: float(self.engine.config.max_num_seqs)}

    async def engine_stats(self) -> dict:
        """The engine's gauges and counters (kvserve.engine.stats.EngineStats), for operators and tests:
        `serve.get_deployment_handle(...).engine_stats.remote()`."""
        return {"replica": self.replica_id, **dataclasses.asdict(self.engine.stats)}

    async def check_health(self) -> None:
        """Ray Serve's health check (every HEALTH_CHECK_PERIOD_S): raises while the engine is not serving.
        An engine that died is restarted by the engine client within seconds, so Ray, which replaces a
        replica after a few failed checks in a row, only steps in when restarts keep failing; without this
        a replica in a crash loop stayed HEALTHY, answering every request with a 503."""
        if self.engine.dead is not None:
            raise RuntimeError(f"model {self.name}: {self.engine.dead}")

    async def model_card(self) -> dict:
        return ModelCard(id=self.name, root=self.name, max_model_len=self.engine.max_model_len).model_dump()


def _coalesce(msg: dict, messages: asyncio.Queue) -> dict:
    """`msg` joined with the body chunks the app has already queued behind it: under load one Ray message
    carries several tokens' SSE events instead of one each, and an idle stream still sends at once."""
    body, more = msg.get("body", b""), msg.get("more_body", False)
    while more and not messages.empty():
        nxt = messages.get_nowait()
        if nxt is None or nxt["type"] != "http.response.body":
            messages.put_nowait(nxt)  # the end of the app (None) is always last: putting it back keeps order
            break
        body += nxt.get("body", b"")
        more = nxt.get("more_body", False)
    return {"type": "http.response.body", "body": body, "more_body": more}
