"""Export the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) for the peers we compare with.

Writes, under third_party/models/ (git-ignored):
  SmolLM2-135M-Instruct.F16.gguf   -- for llama.cpp: dequantized to F16, which is what llama.cpp runs
                                       fastest under concurrent load (Q4_1 only wins at one stream)
  SmolLM2-135M-Instruct-hf/        -- config.json, model.safetensors, tokenizer.json,
                                       tokenizer_config.json (with chat_template): for
                                       `transformers serve` and transformers `generate` baselines
and checks that the HF directory answers the France question correctly with greedy decoding.

Usage: python benchmarks/peers/export_default.py [--out third_party/models] [--skip-check] [--force]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvserve.bench.tokenizer import default_model_path  # noqa: E402

F16_NAME = "SmolLM2-135M-Instruct.F16.gguf"
HF_NAME = "SmolLM2-135M-Instruct-hf"


def write_f16_gguf(src: Path, dst: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        # GGUF.* are the container's own header fields; the writer emits those, and the
        # architecture key is added by the writer's constructor.
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # llama.cpp keeps 1-D tensors (norms) in F32; every matrix goes to F16. The layout --
        # including the rotary permutation of Q/K -- is unchanged, as llama.cpp expects it.
        w = w.astype(np.float32 if w.ndim == 1 else np.float16)
        writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hf_dir(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers dequantizes the GGUF and undoes llama.cpp's Q/K permutation itself.
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    dst.mkdir(parents=True, exist_ok=True)
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; its weights are
    # plain float tensors by now, so move them into an unflagged model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    plain.tie_weights()
    # float32: the dequantized Q4_1 values are exact in float32, not in bf16/f16.
    plain.save_pretrained(str(dst))
    tok.save_pretrained(str(dst))
    # transformers 5 puts the template in chat_template.jinja; tools that read only
    # tokenizer_config.json (and older transformers) need it there too.
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if not cfg.get("chat_template"):
        cfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def check_hf_dir(d: Path, gguf_path: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from kvserve.bench.tokenizer import load_tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ref = load_tokenizer(gguf_path)
    sample = "ROMEO. 1234 apples -- O, she doth teach the torches to burn bright! <|im_end|>\n"
    a, b = tok.encode(sample, add_special_tokens=False).ids, ref.encode(sample)
    assert a == b, f"exported tokenizer.json disagrees with the GGUF tokenizer:\n{a}\n{b}"

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    prompt = ref.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer, "the exported model does not answer the France question"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "third_party" / "models"))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--force", action="store_true", help="rewrite outputs that already exist")
    args = ap.parse_args()
    src = default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.force or not (out / F16_NAME).exists():
        t = time.perf_counter()
        write_f16_gguf(src, out / F16_NAME)
        print(f"wrote {out / F16_NAME} ({time.perf_counter() - t:.1f}s)")
    if args.force or not (out / HF_NAME / "model.safetensors").exists():
        t = time.perf_counter()
        write_hf_dir(src, out / HF_NAME)
        print(f"wrote {out / HF_NAME} ({time.perf_counter() - t:.1f}s)")
    if not args.skip_check:
        check_hf_dir(out / HF_NAME, src)
        print("check passed: tokenizer.json matches the GGUF tokenizer; greedy answer mentions Paris")
    return 0


if __name__ == "__main__":
    sys.exit(main())
