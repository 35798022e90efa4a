"""One served model: its replicas (one engine client, AsyncLLM, per engine process), the admission queue in
front of them and the routing policy that picks a replica for each request (DESIGN.md §8).

The HTTP layer sees a ServedModel as it saw the one engine before: a tokenizer, max_model_len, vocab_size,
the engine config, and `generate`. With one replica there is nothing to route and no digest is computed."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from kvserve.config import EngineConfig
from kvserve.engine.block_hash import block_hashes
from kvserve.entrypoints.async_llm import AsyncLLM, EngineMode, ServerStopping
from kvserve.gateway.admission import AdmissionQueue, EngineView, NoReplica
from kvserve.gateway.routing import CacheAwarePolicy, make_policy
from kvserve.outputs import RequestDelta
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.gateway")

# While requests wait in the queue, it is re-checked this often (a replica may have come back to life).
_PUMP_INTERVAL_S = 0.25
# Requests waiting while every replica's engine stays down this long are answered 503, as new ones are at once:
# an engine that cannot be restarted (its restarts back off up to 30 s each) had held them until their clients
# gave up. Shorter outages (an engine replaced in a few seconds) keep them in line.
ALL_DEAD_WAIT_S = 30.0


class ServedModel:
    def __init__(self, name: str, config: EngineConfig, *, num_replicas: int = 1, policy: str = "cache_aware",
                 max_waiting: int | None = None, engine_mode: EngineMode = "process",
                 aliases: list[str] | None = None) -> None:
        self.name = name
        self.aliases = [name, *(a for a in aliases or [] if a != name)]   # names clients may send
        # Admission is the queue's job here; the engines take whatever they are sent.
        self.config = replace(config, max_waiting=None)
        if policy == "cache_aware" and not self.config.enable_prefix_caching:
            # Nothing is cached to route by: crediting prefixes the engines never keep had held traffic on one
            # replica until the load imbalance overrode it.
            logger.info("model %s: prefix caching is off, so replicas are picked least_loaded, not cache_aware",
                        name)
            policy = "least_loaded"
        self.policy = make_policy(policy, num_replicas, self.config.block_size)
        self.replicas = [AsyncLLM(self.config, mode=engine_mode) for _ in range(num_replicas)]
        self.queue = AdmissionQueue(num_replicas, self.config.max_num_seqs, self.policy, self._engine_view,
                                    max_waiting=max_waiting)
        self._pumper: asyncio.Task | None = None
        self.all_dead_wait_s = ALL_DEAD_WAIT_S

    # ---- what the HTTP layer reads (replica 0 speaks for all: they load the same model) --------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def dead(self) -> str | None:
        """Why no replica can serve, if none can."""
        reasons = [r.dead for r in self.replicas]
        return None if any(d is None for d in reasons) else "; ".join(d for d in reasons if d)

    @property
    def num_unhealthy(self) -> int:
        return sum(r.dead is not None for r in self.replicas)

    def _engine_view(self, i: int) -> EngineView:
        r = self.replicas[i]
        return EngineView(r.stats.num_running, r.num_waiting, r.stats.kv_cache_usage, r.dead is None)

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Starts every replica's engine at once; if one fails, stops the others and raises."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = next((e for e in results if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.shutdown()
            raise failed
        for i, r in enumerate(self.replicas):
            r.restart_listeners.append(lambda i=i: self._on_restart(i))
        self._pumper = asyncio.create_task(self._pump_while_waiting())

    def _on_restart(self, replica: int) -> None:
        if isinstance(self.policy, CacheAwarePolicy):
            self.policy.forget(replica)   # a new engine process starts with an empty prefix cache

    async def _pump_while_waiting(self) -> None:
        dead_since: float | None = None
        while True:
            await asyncio.sleep(_PUMP_INTERVAL_S)
            if any(r.dead is None for r in self.replicas):
                dead_since = None
            elif dead_since is None:
                dead_since = time.monotonic()
            elif time.monotonic() - dead_since >= self.all_dead_wait_s and self.queue.num_waiting:
                why = self.replicas[0].dead
                self.queue.fail_waiting(lambda: NoReplica(f"no engine of this model has run for "
                                                          f"{self.all_dead_wait_s:g} s ({why}); retry later"))
            if self.queue.num_waiting:
                self.queue.pump()

    async def shutdown(self) -> None:
        if self._pumper is not None:
            self._pumper.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas), return_exceptions=True)

    def stop_requests(self, why: str) -> None:
        """Shutdown after the grace period: the queue's waiters first (so the places freed next admit nobody),
        then every running request, each answered with ServerStopping(why)."""
        self.queue.close(lambda: ServerStopping(why))
        for r in self.replicas:
            r.stop_requests(why)

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestDelta]:
        """Waits for a place (QueueFull / NoReplica if there is none to wait for), then streams the
        request's deltas from the replica it was routed to."""
        digests = []
        if isinstance(self.policy, CacheAwarePolicy) and len(self.replicas) > 1:
            digests = block_hashes(prompt_token_ids, self.config.block_size, cache_salt)
        placement = await self.queue.acquire(digests, priority, params.n, len(prompt_token_ids))
        finished = False
        try:
            gen = self.replicas[placement.replica].generate(prompt_token_ids, params, request_id=request_id,
                                                            priority=priority, cache_salt=cache_salt,
                                                            arrival_time=arrival_time)
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    if placement.prefill_tokens:
                        self.queue.first_token(placement)
                    finished = delta.finished and not any(c.finish_reason == "abort" for c in delta.outputs)
                    yield delta
        finally:
            # Only requests that ran to their end say how fast places free (Retry-After): a burst of aborts (clients
            # gone, an engine that died) had made the 429s say "retry in 1 s" while nothing was draining.
            self.queue.release(placement, finished=finished)
