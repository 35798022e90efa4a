"""`kvserve bench serve` against the peers we compare with (llama.cpp's llama-server, transformers
serve), when they have been prepared under third_party/ (benchmarks/README.md, "Set-up"): every
request succeeds, generates exactly max_tokens, and the peer counts each prompt as we do."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from kvserve.bench.cli import build_parser, serve_config_from_args
from kvserve.bench.cli import main as bench_main
from kvserve.bench.launch import launch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "third_party" / "models"
LLAMA_SERVER = ROOT / "third_party" / "llama.cpp" / "build" / "bin" / "llama-server"
HF_DIR = MODELS / "SmolLM2-135M-Instruct-hf"

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_run(tmp_path: Path, argv: list[str]) -> None:
    from kvserve.bench.datasets import sample_requests
    from kvserve.bench.tokenizer import load_tokenizer

    out = tmp_path / "r.json"
    assert bench_main([*argv, "--save-result", str(out), "--disable-tqdm"]) == 0
    d = json.loads(out.read_text())
    reqs = d["requests"]
    assert d["metrics"]["failed"] == 0, [r["error"] for r in reqs]
    assert all(r["usage_reported"] and r["output_tokens"] == r["max_tokens"] for r in reqs)
    cfg = serve_config_from_args(build_parser().parse_args(argv), "")
    expected = [r.prompt_len for r in sample_requests(cfg.dataset, load_tokenizer())]
    assert [r["prompt_len"] for r in reqs] == expected


@pytest.mark.skipif(not (LLAMA_SERVER.exists() and (MODELS / "SmolLM2-135M-Instruct.F16.gguf").exists()),
                    reason="run benchmarks/peers/build_llama_server.sh and export_default.py first")
@pytest.mark.parametrize("dataset", ["random", "chat"])
def test_bench_against_llama_server(tmp_path, dataset):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch("llama.cpp", f"{ROOT}/benchmarks/peers/llama_server.sh {port} 4 2 1024", url,
                    tmp_path, timeout_s=120)
    try:
        _check_run(tmp_path, ["serve", "--base-url", url, "--model", "SmolLM2-135M-Instruct",
                              "--dataset", dataset, "--num-prompts", "4", "--max-concurrency", "4",
                              "--input-len", "48", "--range-ratio", "0.5", "--output-len", "6",
                              "--message-len", "16", "--seed", "2"])
    finally:
        server.stop()


@pytest.mark.skipif(not (HF_DIR / "model.safetensors").exists() or shutil.which("transformers") is None
                    or importlib.util.find_spec("accelerate") is None,
                    reason="run benchmarks/peers/export_default.py and install accelerate first")
def test_bench_against_transformers_serve(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch("transformers", f"{ROOT}/benchmarks/peers/transformers_serve.sh {port} 2",
                    url, tmp_path, timeout_s=300)
    try:
        _check_run(tmp_path, ["serve", "--base-url", url, "--model",
                              os.path.relpath(HF_DIR, ROOT), "--ignore-eos-via", "generation-config",
                              "--dataset", "chat", "--num-prompts", "3", "--max-concurrency", "3",
                              "--output-len", "6", "--message-len", "16", "--max-turns", "2"])
    finally:
        server.stop()


LCP_VENV = ROOT / "third_party" / "venv-llama-cpp-python"


@pytest.mark.skipif(not ((LCP_VENV / "bin" / "python").exists()
                         and (MODELS / "SmolLM2-135M-Instruct.F16.gguf").exists()),
                    reason="run benchmarks/peers/build_llama_cpp_python.sh and export_default.py first")
def test_bench_against_llama_cpp_python_server(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch("llama-cpp-python", f"{ROOT}/benchmarks/peers/llama_cpp_python_server.sh {port} 2",
                    url, tmp_path, timeout_s=120)
    out = tmp_path / "r.json"
    try:
        assert bench_main(["serve", "--base-url", url, "--model", "SmolLM2-135M-Instruct",
                           "--ignore-eos-via", "logit-bias", "--num-prompts", "3",
                           "--max-concurrency", "3", "--input-len", "32", "--output-len", "8",
                           "--save-result", str(out), "--disable-tqdm"]) == 0
    finally:
        server.stop()
    reqs = json.loads(out.read_text())["requests"]
    assert all(r["success"] for r in reqs)
    # No usage from this server: one token per streamed chunk, and no early EOS stop.
    assert all(not r["usage_reported"] and len(r["itl_s"]) + 1 == r["max_tokens"] for r in reqs)
