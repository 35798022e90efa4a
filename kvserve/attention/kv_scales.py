"""Scales for a float8 KV cache, calibrated once per layer when the engine starts.

A float8 (e4m3) cache stores K / k_scale and V / v_scale. e4m3 keeps 3 mantissa bits over magnitudes
2^-6 .. 448 and loses precision below (subnormals) and everything above (saturation), while a layer's K or V
may sit anywhere: the default model's first layer has V values of ~0.06 (rms), deep in the subnormals at a
scale of 1.0, while some models' K reach hundreds. So each layer's scales map the largest |K| and |V| seen on
a short calibration text to FP8_MAX / HEADROOM: typical values land in the normal range, and values up to
HEADROOM times the calibrated maximum still fit.

vLLM computes its scales the same way from the first batch it serves (amax over a constant); a fixed text
here makes them the same on every start, whatever the first request is.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from kvserve.attention.backend import FP8_MAX, AttentionBackend, KVCache, StepBatch
from kvserve.layers.attention import attention_layers

logger = logging.getLogger(__name__)

HEADROOM = 4.0
# Prose, code, numbers and a dialogue turn: the kinds of text a server sees, in ~200 tokens.
CALIBRATION_TEXT = (
    "The committee met on Tuesday, 14 March 2023, to review the budget for the new library wing. "
    "After a long discussion, members agreed to spend $1.2 million on shelving, lighting and 48 study desks.\n\n"
    "def moving_average(values, window=3):\n"
    "    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"\n"
    "    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]\n\n"
    "User: Can you explain why the sky is blue?\n"
    "Assistant: Sunlight is scattered by the molecules of the air, and shorter (blue) wavelengths scatter "
    "much more than longer (red) ones, so blue light reaches our eyes from every direction of the sky.\n"
    "| city | population | area (km2) |\n| Paris | 2,102,650 | 105.4 |\n| Lyon | 522,250 | 47.9 |\n"
)


def scale_for(amax: float) -> float:
    """The scale that maps a calibrated maximum |x| to FP8_MAX / HEADROOM (1.0 for a layer of zeros)."""
    return amax * HEADROOM / FP8_MAX if amax > 0 and math.isfinite(amax) else 1.0


@contextmanager
def layers_only(model: nn.Module) -> Iterator[None]:
    """The model's forward through its Python layers (a native decoder stack, if any, bypasses them)."""
    stack = getattr(model, "native_stack", None)
    if stack is not None:
        model.native_stack = None
    try:
        yield
    finally:
        if stack is not None:
            model.native_stack = stack


@torch.inference_mode()
def calibrate_kv_scales(model: nn.Module, backend: AttentionBackend, kv_caches: list[KVCache], block_size: int,
                        token_ids: list[int], device: torch.device) -> list[tuple[float, float]]:
    """Run token_ids through the model as one prompt and set every attention layer's k_scale / v_scale from
    the largest |K| and |V| it computed; returns them per layer. Writes K/V into the pool's first blocks:
    call it before any request holds one."""
    layers = attention_layers(model)
    n = len(token_ids)
    blocks = list(range(-(-n // block_size)))
    meta = backend.build_metadata(StepBatch.from_host([blocks], list(range(n)), [0, n], [n], block_size, device))
    for layer in layers:
        layer.kv_amax = torch.zeros(2, dtype=torch.float32, device=device)
    try:
        with layers_only(model):
            model(torch.tensor(token_ids, dtype=torch.int64, device=device),
                  torch.arange(n, dtype=torch.int64, device=device), meta, kv_caches)
        scales = []
        for layer in layers:
            k_amax, v_amax = layer.kv_amax.tolist()
            layer.k_scale, layer.v_scale = scale_for(k_amax), scale_for(v_amax)
            scales.append((layer.k_scale, layer.v_scale))
    finally:
        for layer in layers:
            layer.kv_amax = None
    logger.info("float8 KV scales calibrated on %d tokens: k %.3g..%.3g, v %.3g..%.3g", n,
                min(k for k, _ in scales), max(k for k, _ in scales), min(v for _, v in scales),
                max(v for _, v in scales))
    return scales
