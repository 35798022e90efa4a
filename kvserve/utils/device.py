"""Pick the device and the compute dtype ("auto" resolves to what runs fastest without losing accuracy)."""
from __future__ import annotations

from functools import cache

import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.utils.cpuinfo import cpu_flags

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA through pinned memory and a non-blocking copy: a plain
    torch.tensor(..., device="cuda") waits for the GPU to drain before copying (a host sync), which would stall
    a step between scheduling and sampling. The pinned buffer stays reserved until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype, cpu_auto: bool = False) -> torch.dtype:
    """auto: the compute dtype, except bfloat16 under cpu_auto (a CPU whose compute dtype was chosen by dtype
    "auto", with kvserve's kernels). There float32 compute stands in for emulated bfloat16 arithmetic, but
    K and V are only stored and read back: a bfloat16 cache halves the bytes a decode step reads and the
    memory per token (batch-1 decode 1.19-1.25x faster at 1500 tokens of context, 1.24-1.36x at 3000 on
    AVX2: benchmarks/results/kv_cache_dtype_avx2.md), as llama.cpp's 16-bit cache does. An explicit
    float32 dtype keeps a float32 cache."""
    if name == "auto":
        return torch.bfloat16 if cpu_auto and compute_dtype == torch.float32 else compute_dtype
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {name!r}")
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        # Without native bf16 instructions, bf16 matmuls are emulated and slower than fp32.
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


@cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX512-BF16 or AMX-BF16). Not where KVSERVE_CPU_ISA
    forces the avx2 kernels: that stands in for an AVX2 CPU, so dtype "auto" picks what such a CPU gets."""
    if cpu_kernels.requested_isa() == "avx2":
        return False
    flags = cpu_flags()
    if flags is not None:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    # No /proc (macOS, Windows): torch's own view of the CPU.
    return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
