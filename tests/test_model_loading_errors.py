"""Models kvserve cannot run as written are refused at load, in one line naming why (they had loaded and answered
wrongly, or failed with a traceback)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.models.loader import load_model


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, said", [
    # Its weights had been read as floats with their scales left aside, then refused for an "unexpected bias".
    ({"quantization_config": {"quant_method": "fp8"}}, "pre-quantized checkpoints are not supported.*'fp8'"),
    ({"intermediate_size": None}, "config.json lacks intermediate_size"),          # had been a KeyError
])
def test_hf_directories_kvserve_cannot_run_are_named(tiny_model_dirs, tmp_path, changes, said):
    path = edited_copy(tiny_model_dirs["llama"][0], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=said):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_gemma3_in_float16_is_refused(tmp_path):
    """Its activations overflow float16: every logit was NaN and token 0 came out for ever, without an error
    (vLLM refuses it too)."""
    from test_gemma3_parity import build_gemma3
    build_gemma3("tied_softcap", tmp_path / "g")
    with pytest.raises(ValueError, match="Gemma 3 is numerically unstable in float16"):
        load_model(str(tmp_path / "g"), torch.float16, torch.device("cpu"))
    load_model(str(tmp_path / "g"), torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("window_layers, layer_types, expected", [
    (None, ["full_attention"] * 2, None),       # every layer attends to everything: no window (it had slid)
    (0, None, 4),                               # every layer slides
    (1, None, "some layers only"),              # layer 1 slides, layer 0 not: refused, not run wrong
])
def test_qwen_sliding_window_follows_its_layers(tiny_model_dirs, tmp_path, window_layers, layer_types, expected):
    from kvserve.models.hf import read_hf_config
    src = tiny_model_dirs["qwen2"][0]
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert layers == 2
    path = edited_copy(src, tmp_path / "q", use_sliding_window=True, sliding_window=4,
                       max_window_layers=layers if window_layers is None else window_layers, layer_types=layer_types)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            read_hf_config(path)
    else:
        assert read_hf_config(path).sliding_window == expected


def test_a_weight_the_architecture_does_not_have_is_named(tiny_model_dirs, tmp_path):
    """A checkpoint with a tensor kvserve's model has no place for (a vision tower's, another layout's): a KeyError
    traceback before."""
    from safetensors.torch import load_file, save_file
    path = edited_copy(tiny_model_dirs["llama"][0], tmp_path / "m")
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(shard)
    save_file({**tensors, "model.vision_tower.proj.weight": torch.zeros(2, 2)}, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'vision_tower.proj.weight'"):
        load_model(str(path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_weight_too_narrow_for_blocks_is_named(tmp_path, monkeypatch, quantization):
    """An MLP 100 wide cannot be cut into blocks of 32: the error had named neither the weight nor the way out."""
    import tiny_models

    monkeypatch.setitem(tiny_models.COMMON, "intermediate_size", 100)
    tiny_models.make_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.mlp.down_proj.weight': in_features 100 .*"
                                         r"--quantization none"):
        load_model(str(tmp_path / "m"), torch.float32, torch.device("cpu"), quantization=quantization)


def test_a_cut_short_safetensors_file_is_named(tiny_model_dirs, tmp_path):
    """A download that stopped: safetensors' "incomplete metadata" had named neither the file nor the cause."""
    path = edited_copy(tiny_model_dirs["llama"][0], tmp_path / "m")
    (shard,) = path.glob("*.safetensors")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_a_mixture_of_experts_gguf_is_named():
    from kvserve.models.gguf import gguf_model_config
    meta = {"general.architecture": "llama", "llama.expert_count": 8, "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="mixture-of-experts models \\(8 experts\\) are not supported"):
        gguf_model_config(meta, {})
