import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Test servers run beside the test process on two cores. OpenMP's default busy-waiting then makes every
# torch op stall on the other process (measured: a decode step 4x slower); passive waiting does not.
# Set before torch loads its OpenMP runtime; server subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Per architecture: (saved Hugging Face directory, the transformers model itself)."""
    from tiny_models import arch_specs, make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_model(arch, root / arch)) for arch in arch_specs()}
