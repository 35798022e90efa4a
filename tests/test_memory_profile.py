"""KV-pool sizing for --gpu-memory-utilization: the arithmetic and the worst-case step, on the CPU (the
measurement itself, profile_kv_budget, needs CUDA)."""
from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser, engine_config
from kvserve.models.kv_cache import kv_cache_spec
from kvserve.models.loader import load_model
from kvserve.worker.memory_profile import MemoryProfile, kv_cache_bytes, worst_case_batch
from kvserve.worker.model_runner import ModelRunner

GiB = 2 ** 30


def test_kv_cache_bytes_is_what_the_budget_leaves() -> None:
    # An 80 GiB GPU at 0.9: 72 GiB, less 1.5 GiB of weights, 2.25 of activations, 0.75 outside torch.
    p = MemoryProfile(80 * GiB, int(1.5 * GiB), int(2.25 * GiB), int(0.75 * GiB))
    assert kv_cache_bytes(p, 0.9) == int(72 * GiB) - int(4.5 * GiB)
    assert kv_cache_bytes(p, 1.0) == int(75.5 * GiB)
    # Lower utilization leaves room to other processes, and the KV pool shrinks by exactly that much.
    assert kv_cache_bytes(p, 0.9) - kv_cache_bytes(p, 0.5) == int(72 * GiB) - 40 * GiB


def test_kv_cache_bytes_refuses_when_nothing_is_left() -> None:
    p = MemoryProfile(16 * GiB, 6 * GiB, 2 * GiB, GiB)
    with pytest.raises(ValueError, match="no memory left for the KV cache.*gpu-memory-utilization"):
        kv_cache_bytes(p, 0.5)  # 8 GiB allowed, 9 used
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            kv_cache_bytes(p, bad)


def test_worst_case_batch_fills_the_step_budget() -> None:
    b = worst_case_batch(1024, 128, 16)
    assert len(b.query_lens) == 128 and sum(b.query_lens) == 1024
    assert b.query_lens[0] == 897 and set(b.query_lens[1:]) == {1}
    assert b.num_blocks == 57 + 127                      # ceil(897 / 16) for the prefill, one per decode row
    assert len(b.slots) == 1024 and len(set(b.slots)) == 1024
    assert min(b.slots) == 0 and max(b.slots) < b.num_blocks * 16
    assert worst_case_batch(8, 32, 4).query_lens == [1] * 8  # more sequences than tokens: one token each


def test_profile_run_writes_the_worst_case_step(tiny_model_dirs) -> None:
    """The runner's profile step runs the whole batch on a pool of exactly worst_case_batch's blocks: every
    slot it names is written, every sequence sampled."""
    path, _ = tiny_model_dirs["llama"]
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    dummy = worst_case_batch(40, 6, 4)
    spec = kv_cache_spec(loaded.config, 4, torch.float32)
    runner = ModelRunner(loaded.model, spec, dummy.num_blocks, torch.device("cpu"), [1], torch.float32, "torch")
    tokens = runner.profile_run(40, 6)
    assert tokens.shape == (6,) and ((0 <= tokens) & (tokens < loaded.config.vocab_size)).all()
    # With speculative decoding, draft rows' logits and samples too, up to the step's tokens.
    assert runner.profile_run(40, 6, num_draft_rows=12).shape == (18,)
    assert runner.profile_run(40, 6, num_draft_rows=100).shape == (40,)
    k_cache = runner.kv_caches[0][0]                      # torch layout: [Hkv, NB, bs, D]
    written = k_cache.flatten(1, 2).abs().sum((0, 2)) != 0
    assert written.tolist() == [s in set(dummy.slots) for s in range(dummy.num_blocks * 4)]


def test_gpu_memory_utilization_option() -> None:
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.6"])
    assert engine_config(args).gpu_memory_utilization == 0.6
    assert EngineConfig().gpu_memory_utilization == 0.9      # vLLM's default
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)
