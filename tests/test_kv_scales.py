"""Float8 KV cache scales, calibrated per layer at start-up (kvserve/attention/kv_scales.py): on a model
whose K and V run far past e4m3's +-448, the calibrated cache still tracks transformers, and a cache
without scales (1.0) saturates and does not."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.backend import FP8_MAX
from kvserve.attention.kv_scales import HEADROOM, scale_for
from kvserve.layers.attention import attention_layers
from tiny_models import TINY_KV, make_tiny_model

MAGNIFY = 400.0  # K and V this many times larger, q and o this many times smaller: the same function
PROMPT = list(range(40, 140))


@pytest.fixture(scope="module")
def loud_model(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A tiny Llama with K and V beyond e4m3's range, and transformers' log-probs of PROMPT's tokens."""
    path = tmp_path_factory.mktemp("loud_kv")
    hf = make_tiny_model("llama", path)
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.mul_(MAGNIFY)
            attn.q_proj.weight.div_(MAGNIFY)
            attn.v_proj.weight.mul_(MAGNIFY)
            attn.o_proj.weight.div_(MAGNIFY)
        hf.save_pretrained(path, safe_serialization=True)
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    return path, ref


def prompt_logprobs(model: LLM) -> torch.Tensor:
    (out,) = model.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    return torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], PROMPT[1:])])


def test_calibrated_scales_keep_a_loud_model_within_range(loud_model) -> None:
    path, ref = loud_model
    llm = LLM(str(path), dtype="float32", quantization="none", kv_cache_dtype="fp8_e4m3", kv_cache_memory=TINY_KV)
    layers = attention_layers(llm.engine.runner.model)
    # The calibrated maxima (scale * FP8_MAX / HEADROOM) show the K and V the fixed text produced.
    amax = [s * FP8_MAX / HEADROOM for layer in layers for s in (layer.k_scale, layer.v_scale)]
    assert min(amax) > 2 * FP8_MAX, amax  # the model does need scales: unscaled, its K and V saturate
    calibrated = (prompt_logprobs(llm) - ref).abs().mean().item()
    for layer in layers:
        layer.k_scale = layer.v_scale = 1.0
    unscaled = (prompt_logprobs(llm) - ref).abs().mean().item()
    # 3 mantissa bits per value: a few hundredths of a nat from the float model, as with ordinary K/V
    # (test_quantized_model.py); saturated values give unrelated attention.
    assert calibrated < 0.15, calibrated
    assert unscaled > 5 * calibrated, (calibrated, unscaled)


def test_scales_map_the_calibrated_maximum_below_fp8s_limit() -> None:
    assert 1000.0 / scale_for(1000.0) == pytest.approx(FP8_MAX / HEADROOM)
    assert 0.01 / scale_for(0.01) == pytest.approx(FP8_MAX / HEADROOM)
    assert scale_for(0.0) == 1.0 and scale_for(float("nan")) == 1.0
