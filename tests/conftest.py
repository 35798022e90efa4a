import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Two cores: keep torch from oversubscribing them when a test server runs beside the test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Per architecture: (saved Hugging Face directory, the transformers model itself)."""
    from tiny_models import arch_specs, make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, make_tiny_model(arch, root / arch)) for arch in arch_specs()}
