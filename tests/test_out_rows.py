"""A step's forward for its sampled rows alone: the runner passes the model out_rows (a prompt chunk samples
its last row or none), and the model's last layer runs its o projection and MLP (the native stack its
attention too) for those rows only. The same tokens and log-probabilities, bit for bit, as a forward of
every row whose sampled rows are kept afterwards (runner.sampled_rows_only False); on the native stack and on
the layers, for Llama-family models and Gemma 3."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from tests.tiny_models import make_tiny_model

PROMPTS = ["a", "Mixed lengths in one batch, ", "The decoder stack " * 6, "xyz " * 20]
LONG = "A prompt longer than one step's budget of tokens, " * 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("out_rows")
    for arch in ("llama", "qwen3"):
        make_tiny_model(arch, root / arch)
    return {arch: root / arch for arch in ("llama", "qwen3")}


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """The prompts in one batch, then a long one alone (its first chunks sample nothing)."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.generate([LONG], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def compare(llm: LLM) -> None:
    model = llm.engine.runner.model
    forward, trimmed = model.forward, []

    def counting(input_ids, positions, meta, kv_caches, out_rows=None):
        if out_rows is not None:
            trimmed.append((len(input_ids), len(out_rows)))
        return forward(input_ids, positions, meta, kv_caches, out_rows)
    model.forward = counting
    alone = run(llm)
    # Prompt chunks shared steps with decodes, and some sampled nothing.
    assert any(k < n for n, k in trimmed) and any(k == 0 for _, k in trimmed), trimmed
    llm.engine.runner.sampled_rows_only = False  # every row, the sampled ones kept after (as before)
    trimmed.clear()
    assert run(llm) == alone and not trimmed


@pytest.mark.parametrize("arch,quantization,native", [("llama", "int4", True), ("llama", "int4", False),
                                                      ("llama", "none", False), ("qwen3", "int8", False)])
def test_sampled_rows_alone_give_every_rows_bits(tiny_dirs, arch: str, quantization: str, native: bool) -> None:
    # A budget of 24 tokens a step splits the longer prompts into chunks that share steps with decodes.
    llm = LLM(model=str(tiny_dirs[arch]), dtype="float32", quantization=quantization, max_num_batched_tokens=24,
              num_kv_blocks=64, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if native:
        if not cpu_kernels.available():
            pytest.skip("no native CPU kernels on this machine")
        assert model.native_stack is not None
    else:
        model.native_stack = None
    compare(llm)


def test_gemma3_sampled_rows_alone_give_every_rows_bits() -> None:
    llm = LLM(model="gemma3-270m", max_num_batched_tokens=24, kv_cache_memory=1 << 28, enable_prefix_caching=False)
    compare(llm)
