"""The registry of served models without engines: names, aliases and `auto` resolved to the model that will
answer, the AutoRouter the gateway is given, the prompt-length baseline, and each engine's thread share."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.config import EngineConfig
from kvserve.gateway.auto_route import PromptLengthRouter, estimate_tokens
from kvserve.gateway.difficulty import DifficultyRouter
from kvserve.gateway.config import ModelsConfig
from kvserve.gateway.registry import ModelRegistry, UnknownModel, engine_threads

CONFIG = {"models": [{"name": "small", "model": "smollm2-135m", "data_parallel_size": 2},
                     {"name": "large", "model": "gemma3-270m"}],
          "routing": {"policy": "round_robin", "auto": {"small": "small", "large": "large"}}}


def test_names_resolve_to_their_models_and_unknown_names_fail():
    reg = ModelRegistry.from_config(ModelsConfig.from_dict(CONFIG))
    assert reg.names() == ["small", "large", "auto"]
    assert reg.resolve("large").name == "large" and reg.resolve(None).name == "small"
    assert len(reg.resolve("small").replicas) == 2 and reg.resolve("small").policy.name == "round_robin"
    with pytest.raises(UnknownModel, match="`medium` does not exist"):
        reg.resolve("medium")
    one = ModelRegistry.from_config(ModelsConfig.from_models(["smollm2-135m"]), aliases=["smol"])
    assert one.names() == ["smollm2-135m", "smol"] and one.resolve("smol") is one.default
    with pytest.raises(UnknownModel):
        one.resolve("auto")                     # no routing.auto: `auto` is just an unknown name


def test_cache_aware_without_prefix_caching_picks_the_least_loaded():
    """Nothing is cached to route by: crediting prompts the engines never keep had held a shared system prompt's
    traffic on one replica until the load imbalance overrode it."""
    config = {"models": [{"name": "a", "model": "smollm2-135m", "data_parallel_size": 2,
                          "engine": {"enable_prefix_caching": False}},
                         {"name": "b", "model": "smollm2-135m", "data_parallel_size": 2}]}
    reg = ModelRegistry.from_config(ModelsConfig.from_dict(config))
    assert reg.resolve("a").policy.name == "least_loaded" and reg.resolve("b").policy.name == "cache_aware"


def test_auto_asks_the_router_it_was_given():
    class FirstWordRouter:
        def choose(self, prompt_text: str):
            return "large" if prompt_text.startswith("Prove") else "small"

    reg = ModelRegistry.from_config(ModelsConfig.from_dict(CONFIG), auto_router=FirstWordRouter())
    assert reg.resolve("auto", lambda: "Prove that primes are infinite.").name == "large"
    assert reg.resolve("auto", lambda: "Hi!").name == "small"
    # Without one, the trained difficulty router.
    default = ModelRegistry.from_config(ModelsConfig.from_dict(CONFIG))
    assert isinstance(default.auto_router, DifficultyRouter)
    for text in ("What is the capital of France?", "Copy this line: To be or not to be"):
        assert default.resolve("auto", lambda: text).name == default.auto_router.choose(text)


def test_prompt_length_router():
    assert estimate_tokens("Hello, world! 42 apples.") == 7
    r = PromptLengthRouter(threshold_tokens=3)
    assert r.choose("one two three") == "small" and r.choose("one two three four") == "large"
    counted = PromptLengthRouter(threshold_tokens=10, count_tokens=len)       # e.g. a real tokenizer's count
    assert counted.choose("x" * 10) == "small" and counted.choose("x" * 11) == "large"
    with pytest.raises(ValueError):
        PromptLengthRouter(-1)


def test_several_engines_share_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert engine_threads(EngineConfig(), 1).num_threads is None              # one engine: torch's choice
    assert engine_threads(EngineConfig(), 2).num_threads == max(1, cores // 2)
    assert engine_threads(EngineConfig(), 64).num_threads == 1
    assert engine_threads(EngineConfig(num_threads=3), 4).num_threads == 3    # an explicit setting wins
    reg = ModelRegistry.from_config(ModelsConfig.from_dict(CONFIG))
    assert {m.config.num_threads for m in reg.models} == {max(1, cores // 3)}


def test_the_share_counts_the_cores_this_process_may_use():
    """Under taskset or a container's cpuset, the machine's core count overstates what the engines get."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from kvserve.gateway.registry import usable_cores; print(usable_cores(), os.cpu_count())")
    usable, machine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.split()
    assert usable == "1", (usable, machine)
