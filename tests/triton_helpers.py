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
