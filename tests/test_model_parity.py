"""kvserve's paged model vs Hugging Face transformers' full-sequence forward, on tiny random models of
each supported architecture saved with save_pretrained and loaded through kvserve's HF-directory loader.

One scenario per architecture exercises every attention path: prompts of different lengths batched
together (block_size 4, so sequences span several blocks), a prefill split into two chunks with the
prefix already cached, a step mixing that chunk with decodes of the other sequences, and batched
decode steps feeding back the greedy token."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.kernels import cpu as cpu_kernels
from kvserve.attention import torch_plan
from kvserve.models.kv_cache import kv_cache_spec
from kvserve.models.loader import load_model
from paged_helpers import PagedSeqs, make_backend, make_kv_caches, require_native_kernel
from triton_helpers import triton_device

VOCAB = 320
BLOCK_SIZE = 4
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,  # peakier logits than the default 0.02, so greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
)

ARCHS = {
    "llama3_rope_untied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral_tied": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=True, sliding_window=None)),
    # Window shorter than the longest prompt, so both prefill and decode masks must apply it.
    "mistral_window_untied": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=8)),
    "qwen2_bias_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3_qknorm_untied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
}



def write_tokenizer(path: Path) -> None:
    # A word-level tokenizer made offline: the loader needs a tokenizer.json next to the weights.
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = BackendTokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def build_hf_model(name: str, path: Path) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0, which would hide a missing norm or bias.
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# The Triton backend (slow in the interpreter) on two architectures: a sliding window with GQA, and biases.
@pytest.mark.parametrize("name,decode", [
    (name, decode) for decode in ("native-kernel", "native-kernel-long-prefills-sdpa", "one-decode-group",
                                  "decode-group-per-row") for name in ARCHS
] + [("mistral_window_untied", "triton"), ("qwen2_bias_tied", "triton")])
def test_paged_model_matches_transformers(name: str, decode: str, tmp_path: Path, monkeypatch) -> None:
    device = torch.device("cpu")
    if decode.startswith("native-kernel"):
        require_native_kernel()
    elif decode == "triton":  # the Triton backend: on CUDA where present, else in Triton's interpreter
        device = triton_device()
    else:  # the torch path throughout: attention and the fused elementwise ops
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    if decode == "native-kernel-long-prefills-sdpa":  # the 11- and 18-token prefills go to SDPA, the rest to the kernel
        monkeypatch.setattr(torch_plan, "_KERNEL_MAX_PREFILL_CONTEXT", {"avx512": 10, "avx2": 10})
        monkeypatch.setattr(torch_plan, "_KERNEL_ALWAYS_MAX_QUERY", 1)
    if decode == "decode-group-per-row":  # free groups: every row is gathered on its own, padded to its own length
        monkeypatch.setattr(torch_plan, "_GROUP_STRIDE", 1)
        monkeypatch.setattr(torch_plan, "_GROUP_COST_BLOCKS", 0)
    ref = build_hf_model(name, tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, device)
    model, cfg = loaded.model, loaded.config
    assert cfg.architecture == {"llama3": "llama"}.get(name.split("_")[0], name.split("_")[0])
    assert cfg.tie_word_embeddings == ("_tied" in name)
    assert cfg.sliding_window == (8 if "window" in name else None)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 18)]
    backend = make_backend(model, cfg, 64, BLOCK_SIZE, kind="triton" if decode == "triton" else "torch",
                           native_kernels=decode.startswith("native-kernel"), device=device)
    seqs = PagedSeqs(backend)
    kv = make_kv_caches(backend)

    def step(chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        ids, positions, meta = seqs.batch(chunks)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, meta, kv)).cpu()
        starts = meta.query_start_loc_list
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    def check(got: torch.Tensor, full: list[int], n_new: int) -> None:
        want = hf_logits(ref, full)[-n_new:]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # Step 1: two whole prompts and the first chunk of the third, all in one batch.
    chunk = 7
    out = step({0: prompts[0], 1: prompts[1], 2: prompts[2][:chunk]})
    check(out[0], prompts[0], len(prompts[0]))
    check(out[1], prompts[1], len(prompts[1]))
    check(out[2], prompts[2][:chunk], chunk)
    texts = [list(prompts[0]), list(prompts[1]), list(prompts[2])]
    nxt = [int(out[0][-1].argmax()), int(out[1][-1].argmax())]

    # Step 2: decodes for sequences 0 and 1 mixed with the rest of sequence 2's prompt (cached prefix).
    out = step({0: [nxt[0]], 1: [nxt[1]], 2: prompts[2][chunk:]})
    texts[0].append(nxt[0])
    texts[1].append(nxt[1])
    for i in range(3):
        check(out[i], texts[i], len(out[i]))

    # Batched decode steps: all three sequences, greedy tokens fed back, compared every step.
    for _ in range(6):
        greedy = [int(o[-1].argmax()) for o in out]
        for i in range(3):
            assert greedy[i] == int(hf_logits(ref, texts[i])[-1].argmax())
            texts[i].append(greedy[i])
        out = step({i: [greedy[i]] for i in range(3)})
        for i in range(3):
            check(out[i], texts[i], 1)


def test_decode_rows_split_where_padding_costs_more_than_a_group() -> None:
    split = torch_plan.split_by_length
    cost = torch_plan._GROUP_COST_BLOCKS
    assert split([3] * 40) == [40]                               # equal lengths: nothing to save
    assert split([1] * 8 + [4 * cost] * 8) == [8, 16]            # short rows padded to long ones: worth a group
    assert split([10] * 8 + [10 + cost // 16] * 8) == [16]       # saving less than a group costs
    assert split([2, 3]) == [2]                                  # fewer rows than a group boundary step


def test_kv_cache_spec_counts_k_and_v_of_every_layer() -> None:
    from kvserve.config import ModelConfig

    cfg = ModelConfig("llama", 100, 64, 128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=64)
    spec = kv_cache_spec(cfg, block_size=8, dtype=torch.bfloat16)
    from kvserve.attention.torch_backend import TorchPagedBackend

    # The torch backend's layout is head-major: [Hkv, num_blocks, block_size, D].
    assert TorchPagedBackend([], spec, 10, torch.device("cpu"), torch.bfloat16).kv_cache_shape(10) == (2, 10, 8, 16)
    assert spec.bytes_per_block == 2 * 3 * 8 * 2 * 16 * 2


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    build_hf_model("mistral_tied", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    build_hf_model("mistral_tied", tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace("MistralForCausalLM", "GPT2LMHeadModel")
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_tokenizer_option_replaces_the_models_own(tmp_path: Path) -> None:
    from kvserve import LLM, SamplingParams

    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    model_dir.mkdir()
    tok_dir.mkdir()
    build_hf_model("llama3_rope_untied", model_dir)
    # Another word-level vocabulary: "v7" is token 7 here and unknown (token 0) to the model's own.
    word_level_tokenizer().save(str(tok_dir / "tokenizer.json"))

    own = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    assert own.get_tokenizer().encode("v7 v9", add_special_tokens=False) == [0, 0]
    llm = LLM(str(model_dir), tokenizer=str(tok_dir), dtype="float32", num_kv_blocks=64)
    assert llm.get_tokenizer().encode("v7 v9", add_special_tokens=False) == [7, 9]
    out = llm.generate(["v7 v9"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == [7, 9] and out.outputs[0].text.split()[0].startswith("v")
    with pytest.raises(FileNotFoundError, match="tokenizer path"):
        LLM(str(model_dir), tokenizer=str(tmp_path / "missing"), dtype="float32", num_kv_blocks=64)
    # A directory without a tokenizer.json of its own loads with the one given (its own is never read).
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    bare = LLM(str(model_dir), tokenizer=str(tok_dir), dtype="float32", num_kv_blocks=64)
    assert bare.get_tokenizer().encode("v7 v9", add_special_tokens=False) == [7, 9]


def word_level_tokenizer() -> BackendTokenizer:
    """A word-level vocabulary of the tiny models' size: "v7" is token 7 (and anything else "v0")."""
    tok = BackendTokenizer(models.WordLevel({f"v{i}": i for i in range(VOCAB)}, unk_token="v0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok
