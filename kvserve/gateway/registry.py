"""The models a server answers for, by the names clients send (DESIGN.md §8: a registry of named engine
clients). Built from a ModelsConfig: the one-model server is the case of one entry with one replica.

`model: "auto"` (with routing.auto configured) asks an AutoRouter to pick routing.auto's small or large model
from the prompt's text; the response then names the model that answered. A chat request goes only to a model
with a chat template: with a base model as one of the two, its chats go to the other."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace

from kvserve.config import EngineConfig
from kvserve.entrypoints.async_llm import EngineMode, EngineStartupError
from kvserve.gateway.auto_route import AutoRouter
from kvserve.gateway.difficulty import load_default_router
from kvserve.gateway.config import AUTO_MODEL, ModelsConfig
from kvserve.gateway.served_model import ServedModel


class UnknownModel(LookupError):
    pass


class ModelRegistry:
    def __init__(self, models: list[ServedModel], auto: dict[str, str] | None = None,
                 auto_router: AutoRouter | None = None) -> None:
        assert models
        self.models = models
        self._by_name = {alias: m for m in models for alias in m.aliases}
        self.auto = auto
        # The trained difficulty router (kvserve/gateway/difficulty.py; it beat random routing at equal cost in
        # benchmarks/results/auto_routing.md); auto_route.PromptLengthRouter is the simpler baseline.
        self.auto_router = auto_router or (load_default_router() if auto else None)

    @classmethod
    def from_config(cls, config: ModelsConfig, base: EngineConfig | None = None, *,
                    engine_mode: EngineMode = "process", aliases: list[str] | None = None,
                    auto_router: AutoRouter | None = None) -> ModelRegistry:
        """`base`: the command line's engine options, under each entry's `engine` overrides. `aliases`: extra
        names for the first model (--served-model-name in the one-model form)."""
        num_engines = sum(m.data_parallel_size for m in config.models)
        models = []
        for i, entry in enumerate(config.models):
            engine = engine_threads(entry.engine_config(base), num_engines)
            models.append(ServedModel(entry.name, engine, num_replicas=entry.data_parallel_size,
                                      policy=config.routing.policy, max_waiting=config.admission.max_waiting,
                                      engine_mode=engine_mode, aliases=aliases if i == 0 else None))
        return cls(models, config.routing.auto, auto_router)

    # ---- names -------------------------------------------------------------------------------------
    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def names(self) -> list[str]:
        """Every name a client may send, the models' own first, `auto` last when configured."""
        return [a for m in self.models for a in m.aliases] + ([AUTO_MODEL] if self.auto else [])

    def resolve(self, requested: str | None, prompt_text: Callable[[], str] | None = None, *,
                chat: bool = False) -> ServedModel:
        """The model serving a request that names `requested` (none: the first model). For `auto`,
        prompt_text() gives the text the AutoRouter judges; `chat`: the request is rendered with a chat
        template, so a model without one is passed over for the other (if that one has one)."""
        if not requested:
            return self.default
        if requested == AUTO_MODEL and self.auto:
            text = prompt_text() if prompt_text is not None else ""
            model = self._by_name[self.auto[self.auto_router.choose(text)]]
            if chat and not model.has_chat_template:   # the other one, if it has a template
                model = next((m for m in self._auto_models() if m.has_chat_template), model)
            return model
        model = self._by_name.get(requested)
        if model is None:
            raise UnknownModel(f"The model `{requested}` does not exist.")
        return model

    def _auto_models(self) -> list[ServedModel]:
        """`auto`'s small and large models."""
        return [self._by_name[self.auto[k]] for k in ("small", "large")]

    def auto_chat_note(self) -> str | None:
        """For the start-up log: where `auto`'s chats go when one of its two models has no chat template."""
        if not self.auto:
            return None
        bare = [m for m in self._auto_models() if not m.has_chat_template]
        chat = [m for m in self._auto_models() if m.has_chat_template]
        if len(bare) != 1 or len(chat) != 1:
            return None
        return f"chat requests go to {chat[0].name} ({bare[0].name} has no chat template)"

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        results = await asyncio.gather(*(m.start() for m in self.models), return_exceptions=True)
        failed = next(((m, e) for m, e in zip(self.models, results) if isinstance(e, BaseException)), None)
        if failed is not None:
            await self.shutdown()
            model, error = failed
            if len(self.models) > 1 and isinstance(error, EngineStartupError):
                # Which entry of --models-config: the engine's reason names only what it was given.
                raise EngineStartupError(f"model {model.name!r}: {error}") from error
            raise error

    async def shutdown(self) -> None:
        await asyncio.gather(*(m.shutdown() for m in self.models), return_exceptions=True)

    def stop_requests(self, why: str) -> None:
        for m in self.models:
            m.stop_requests(why)

    @property
    def dead(self) -> str | None:
        """Why the server cannot serve everything it was asked to, if so: a model with no live replica."""
        reasons = [f"{m.name}: {m.dead}" for m in self.models if m.dead is not None]
        return "; ".join(reasons) or None


def engine_threads(config: EngineConfig, num_engines: int) -> EngineConfig:
    """Several engine processes on one machine each get an equal share of its cores (at least one thread),
    unless the config sets num_threads: torch's default, a thread per core in every process, would have
    them all contend for every core. One engine keeps torch's choice, as a one-model server always did."""
    if num_engines <= 1 or config.num_threads is not None:
        return config
    return replace(config, num_threads=max(1, usable_cores() // num_engines))


def usable_cores() -> int:
    """The cores this process may run on (taskset, a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:            # not on Linux
        return os.cpu_count() or 1
