"""Sizing the KV pool on a GPU (--gpu-memory-utilization, vLLM's name and meaning): the engine may use
`utilization` of the device's total memory; what the weights, the activation peak of a worst-case step and
the memory outside torch's allocator (CUDA context, cuBLAS workspaces) do not take goes to the KV cache.

The arithmetic is a pure function (kv_cache_bytes), tested on the CPU with numbers; the measurement
(profile_kv_budget) needs CUDA. The worst-case step itself (worst_case_batch) is device-free too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int            # the device's memory
    weights_bytes: int          # torch's allocation after loading the model, before any step
    activation_peak_bytes: int  # the profiled step's peak allocation above the weights (its KV pool excluded)
    non_torch_bytes: int        # used on the device outside torch's allocator (context, workspaces, others)


def kv_cache_bytes(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV pool within total x utilization; ValueError when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(profile.total_bytes * utilization)
    used = profile.weights_bytes + profile.activation_peak_bytes + profile.non_torch_bytes
    if budget <= used:
        gib = 2 ** 30
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{budget / gib:.2f} GiB, but the weights take {profile.weights_bytes / gib:.2f} GiB, the "
            f"activation peak {profile.activation_peak_bytes / gib:.2f} GiB and memory outside torch "
            f"{profile.non_torch_bytes / gib:.2f} GiB; raise --gpu-memory-utilization or lower "
            f"--max-num-batched-tokens / --max-num-seqs")
    return budget - used


@dataclass(frozen=True)
class DummyBatch:
    """A step's shape without sequences: per sequence its new tokens, all its tokens new (no cache)."""
    query_lens: list[int]
    block_tables: list[list[int]]
    slots: list[int]            # one per token, in sequence order

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.block_tables)


def worst_case_batch(num_tokens: int, num_seqs: int, block_size: int) -> DummyBatch:
    """The step with the largest activations the scheduler can produce: num_tokens tokens (the step budget)
    over num_seqs sequences, every one sampled. One long prefill takes what the num_seqs - 1 one-token
    rows leave, since attention's transient memory grows with a chunk's length. Blocks are numbered from
    0 in order, each sequence owning its own."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    query_lens = [num_tokens - (num_seqs - 1)] + [1] * (num_seqs - 1)
    tables, slots, next_block = [], [], 0
    for n in query_lens:
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        tables.append(blocks)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
    return DummyBatch(query_lens, tables, slots)


def profile_kv_budget(run_worst_case_step, device: torch.device, utilization: float,
                      probe_kv_bytes: int) -> tuple[int, MemoryProfile]:
    """CUDA only. run_worst_case_step() builds a runner with a small KV pool of probe_kv_bytes and runs
    one worst-case step; returns (KV bytes, the profile). The weights must be loaded already."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    run_worst_case_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Before empty_cache: what torch's allocator holds is torch's; every other used byte is not.
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    profile = MemoryProfile(total, weights, max(0, peak - weights - probe_kv_bytes), non_torch)
    return kv_cache_bytes(profile, utilization), profile
