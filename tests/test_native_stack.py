"""The native decoder stack (kvserve/models/native_stack.py) against the decoder layers run one by one:
the same tokens and the same log-probabilities, bit for bit, over prefill, chunked prefill and decode
steps of a mixed batch, with quantized and with float weights; and the stack declines what it does not cover."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention import torch_plan
from kvserve.kernels import cpu as cpu_kernels
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels on this machine")

PROMPTS = ["a", "Mixed lengths in one batch, ", "The decoder stack " * 6, "xyz " * 20]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native_stack")
    dirs = {}
    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        make_tiny_model(arch, root / arch)
        dirs[arch] = root / arch
    return dirs


def make_llm(path: Path, dtype: str = "float32", **kw) -> LLM:
    # A small token budget splits the longer prompts into chunks that share steps with decodes.
    return LLM(model=str(path), dtype=dtype, max_num_batched_tokens=32, num_kv_blocks=64,
               enable_prefix_caching=False, **kw)


def run(llm: LLM, prompts: list[str] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def count_native_steps(llm: LLM) -> dict[str, int]:
    """Wraps the model's stack to count the steps it ran and the steps it left to the layers, and among the
    native ones those that wanted some of their rows ("trimmed") and none of them ("no rows")."""
    stack = llm.engine.runner.model.native_stack
    counts = {"native": 0, "layers": 0, "trimmed": 0, "no rows": 0}

    def counting(*args):
        out = stack(*args)
        counts["native" if out is not None else "layers"] += 1
        out_rows = args[4] if len(args) > 4 else None
        if out is not None and out_rows is not None:
            assert len(out[0]) == len(out_rows) < len(args[0])
            counts["trimmed"] += 1
            counts["no rows"] += len(out_rows) == 0
        return out

    llm.engine.runner.model.native_stack = counting
    return counts


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_stack_matches_the_layers_bit_for_bit(tiny_dirs, arch: str, quantization: str) -> None:
    llm = make_llm(tiny_dirs[arch], quantization=quantization)
    model = llm.engine.runner.model
    assert model.native_stack is not None
    counts = count_native_steps(llm)
    native = run(llm)
    # Prompt chunks want one row (a prompt's last) or none; the last layer then runs those alone, while
    # the layers run every row and the model keeps the sampled ones: the same bits either way.
    assert counts["native"] > 0 and counts["layers"] == 0 and counts["trimmed"] > 0, counts
    model.native_stack = None
    assert run(llm) == native


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_weights_match_the_layers_bit_for_bit(tiny_dirs, dtype: str) -> None:
    """Unquantized weights (an HF model as stored) run in the stack on the kernels FloatMethod uses: bfloat16
    ones on AMX tiles where the CPU has AMX-BF16 (the tiny model's shapes fit them), else dense_linear."""
    llm = make_llm(tiny_dirs["llama"], dtype=dtype, quantization="none")
    model = llm.engine.runner.model
    assert model.native_stack is not None
    on_amx = dtype == "bfloat16" and cpu_kernels.amx()
    projections = [w for w in model.native_stack.weights if w is not None and w.dim() > 1]
    assert len(projections) == 4 * len(model.layers)
    assert all(w.dim() == (5 if on_amx else 2) for w in projections), [tuple(w.shape) for w in projections]
    counts = count_native_steps(llm)
    native = run(llm)
    assert counts["native"] > 0 and counts["layers"] == 0 and counts["trimmed"] > 0, counts
    model.native_stack = None
    assert run(llm) == native


def test_a_prompt_chunk_that_samples_nothing_leaves_the_same_cache(tiny_dirs) -> None:
    """A long prompt alone in chunks of 32: its first chunks sample no row, so the stack's last layer stops
    after writing their K/V; what the later steps read from the cache, and so the output, is the layers'."""
    llm = make_llm(tiny_dirs["llama"], quantization="int4")
    counts = count_native_steps(llm)
    prompts = ["A prompt longer than one step's budget of tokens, " * 4]
    native = run(llm, prompts)
    assert counts["no rows"] >= 2 and counts["layers"] == 0, counts
    llm.engine.runner.model.native_stack = None
    assert run(llm, prompts) == native


def test_steps_it_does_not_cover_go_to_the_layers(tiny_dirs, monkeypatch) -> None:
    """A prefill long enough for SDPA puts its step on the layers; the other steps stay native, and the
    result is still the layers' own."""
    monkeypatch.setattr(torch_plan, "_KERNEL_MAX_PREFILL_CONTEXT", {"avx512": 20, "avx2": 20})
    llm = make_llm(tiny_dirs["llama"], quantization="int8")
    counts = count_native_steps(llm)
    native = run(llm)
    assert counts["native"] > 0 and counts["layers"] > 0, counts
    llm.engine.runner.model.native_stack = None
    assert run(llm) == native


@pytest.mark.parametrize("arch,quantization", [("qwen2", "int8"), ("qwen2", "none"), ("qwen3", "int8")])
def test_models_it_does_not_cover_have_no_stack(tiny_dirs, arch: str, quantization: str) -> None:
    """q/k/v biases (Qwen2, quantized or float) and q/k norms (Qwen3) run the layers."""
    llm = make_llm(tiny_dirs[arch], quantization=quantization)
    assert llm.engine.runner.model.native_stack is None
    assert len(run(llm)) == len(PROMPTS)
