"""C++ kernels for CPUs with AVX-512, compiled on first use with torch's extension builder.

The build is cached by torch (under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), so only the
first process on a machine pays for it (~11 s on the 2-core dev machine). Anything that stops it (no
compiler, no AVX-512, KVSERVE_CPU_KERNELS=0) leaves the torch paths in place, and is logged once.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / "paged_attention.cpp", _DIR / "elementwise.cpp"]
# -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP region; without the flag it
# runs on one thread. The library resolves to the libgomp torch has already loaded.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-fopenmp"]


def applies(t: torch.Tensor) -> bool:
    """Whether the kernels can take this tensor: on the CPU, bfloat16 or float32, and built."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32) and available()


@functools.cache
def ops():
    """TEMPORARY until the per-ISA build lands: the AVX2 quant kernel alone."""
    from torch.utils.cpp_extension import load
    _put_ninja_on_path()
    load(name="kvserve_quant_tmp", sources=[str(_DIR / "quant_linear.cpp")],
         extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DKVSERVE_NS=kvserve_tmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.kvserve_tmp


@functools.cache
def available_tmp() -> bool:
    return True


@functools.cache
def available() -> bool:
    """True once torch.ops.kvserve's kernels are registered (building them if need be)."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        logger.info("CPU kernels off: this CPU has no AVX-512 (torch reports %s)",
                    torch.backends.cpu.get_cpu_capability())
        return False
    try:
        from torch.utils.cpp_extension import load
        _put_ninja_on_path()
        # torch rebuilds when the sources or flags change, not the headers: the digest flag covers them.
        digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(_DIR.glob("*.[ch]*")))).hexdigest()[:16]
        load(name="kvserve_cpu_kernels", sources=[str(s) for s in _SOURCES],
             extra_cflags=_FLAGS + [f"-DKVSERVE_SOURCES_DIGEST={digest}"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("CPU kernels off, the build failed: %s", str(e).strip().splitlines()[-1] if str(e) else e)
        return False
    return hasattr(torch.ops.kvserve, "paged_attention_") and hasattr(torch.ops.kvserve, "silu_and_mul")


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv used without activating it has the wheel's ninja off PATH."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
