import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Test servers run beside the test process on two cores. OpenMP's default busy-waiting then makes every
# torch op stall on the other process (measured: a decode step 4x slower); passive waiting does not.
# Set before torch loads its OpenMP runtime; server subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after OMP_WAIT_POLICY)

# Without a GPU the Triton kernels' tests run in Triton's interpreter. It is chosen when a function is
# decorated with triton.jit, triton's own library included, so before anything imports triton (importing
# transformers' models does, during collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Per architecture: (saved Hugging Face directory, the transformers model itself)."""
    from tiny_models import arch_specs, make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_model(arch, root / arch)) for arch in arch_specs()}
