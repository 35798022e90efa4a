"""Where the Triton tests run: on CUDA when present, else on the CPU under Triton's interpreter. Skips
when triton is not installed (a CPU install without the gpu extra)."""
from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        return torch.device("cuda")
    # conftest.py sets it before triton can be imported; a kernel decorated without it could not run here.
    assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1 must be set before triton is imported"
    pytest.importorskip("triton")
    return torch.device("cpu")


def compile_for_gpu(kernel, arg_types: dict[str, str], constexprs: dict, arch: int = 90):
    """Triton's real compiler (not the interpreter) run ahead of time for an NVIDIA target, no GPU needed:
    what a GPU would build at the first launch. It rejects code the interpreter runs (a name that changes
    type between branches, a plain global read by a kernel). arg_types: Triton's type strings ("*bf16",
    "i64", "fp32") per non-constexpr argument. Returns the compiled kernel (its PTX under .asm["ptx"])."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    signature, values = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            values[(i,)] = constexprs[name]
        else:
            signature[name] = arg_types[name]
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
