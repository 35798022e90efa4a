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


# transformers' reading of the default model's GGUF (its dequantization and Q/K un-permutation, none of
# kvserve's code): the independent reference of several modules. Each read parses the file's metadata
# (a 49k-token vocabulary) in Python, 6-9 s, so the suite builds each reference once.

@pytest.fixture(scope="session")
def default_reference_model():
    """A stock LlamaForCausalLM (float32, eager attention) holding transformers' GGUF weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvserve.models.default import default_model_path

    path = default_model_path()
    # from_pretrained(gguf_file=...) needs `accelerate`; this is the same transformers GGUF code path.
    hf_cfg = {k: v for k, v in load_gguf_checkpoint(path)["config"].items() if k != "model_type"}
    config = LlamaConfig(**hf_cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def default_reference_tokenizer():
    """transformers' conversion of the default GGUF's tokenizer (AutoTokenizer with gguf_file=...)."""
    from transformers import AutoTokenizer

    from kvserve.models.default import default_model_path

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
