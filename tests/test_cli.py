"""The `kvserve` command: help that explains every option, option parsing into EngineConfig, the bench
dispatch, and `kvserve generate` end to end on the default model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from kvserve.entrypoints.cli import build_parser, engine_config, main, parse_memory

SERVE_OPTIONS = ["--host", "--port", "--api-key", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory", "--max-model-len", "--no-prefix-caching", "--scheduling-policy",
                 "--max-waiting", "--served-model-name", "--dtype", "--batching", "--kv-cache-dtype", "--quantization"]


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_subcommands_and_every_serve_option(capsys):
    top = _help(["--help"], capsys)
    for sub in ("serve", "generate", "bench"):
        assert sub in top
    serve = _help(["serve", "--help"], capsys)
    for opt in SERVE_OPTIONS:
        assert opt in serve, opt
    # every option carries an explanation, not just its name
    parser = build_parser()
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    for action in serve_parser._actions:  # noqa: SLF001
        if action.option_strings and action.help != "==SUPPRESS==":
            assert action.help, action.option_strings


def test_version_is_printed(capsys):
    from kvserve import __version__
    assert _help(["--version"], capsys) == f"kvserve {__version__}\n"


def test_serve_options_map_to_engine_config():
    args = build_parser().parse_args([
        "serve", "/models/x.gguf", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--block-size", "32",
        "--kv-cache-memory", "512MiB", "--max-model-len", "1024", "--no-prefix-caching",
        "--scheduling-policy", "priority", "--max-waiting", "10", "--dtype", "float32", "--batching", "static",
        "--kv-cache-dtype", "fp8_e4m3"])
    cfg = engine_config(args, max_waiting=args.max_waiting)
    assert cfg.model == "/models/x.gguf" and cfg.max_num_seqs == 8 and cfg.max_num_batched_tokens == 256
    assert cfg.block_size == 32 and cfg.kv_cache_memory == 512 * 2**20 and cfg.max_model_len == 1024
    assert not cfg.enable_prefix_caching and cfg.scheduling_policy == "priority" and cfg.max_waiting == 10
    assert cfg.dtype == "float32" and cfg.batching == "static" and cfg.kv_cache_dtype == "fp8_e4m3"
    # vLLM's name for it.
    assert engine_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8_e4m3"
    defaults = build_parser().parse_args(["serve"])
    assert defaults.host == "127.0.0.1" and defaults.port == 8000 and defaults.prefix_caching


@pytest.mark.parametrize("text,value", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1073741824", 2**30),
                                        ("0.5", 0.5), ("1.5GiB", int(1.5 * 2**30))])
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["lots", "1.5", "0.0", "-3GiB"])
def test_parse_memory_rejects(text):
    with pytest.raises(Exception):
        parse_memory(text)


def test_bench_dispatches_to_bench_cli():
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


@pytest.mark.timeout(300)
def test_generate_from_the_shell():
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "generate", "--max-model-len", "256",
                          "--chat", "--max-tokens", "12", "--prompt", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()  # the model's answer (its wording is the model tests' business)


@pytest.mark.timeout(300)
def test_generate_with_speculation_prints_the_same_text_and_its_acceptance(capsys):
    """`kvserve generate --speculative-config`: the same greedy text as without, and on stderr the drafts'
    acceptance over the run (as llama.cpp's speculative example ends), consistent in its own numbers."""
    import re

    argv = ["generate", "--max-model-len", "256", "--max-tokens", "24",
            "--prompt", "Copy the list: apples, pears, plums, cherries, grapes. Copy: apples, pears,"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert "Speculative decoding" not in plain.err
    # The draft-length rule off: it weighs real step times, which on a slow host could leave 24 tokens undrafted.
    spec = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2, '
            '"adaptive_draft_length": false}')
    assert main([*argv, "--speculative-config", spec]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    m = re.search(r"Speculative decoding: Draft acceptance rate: ([\d.]+)% \((\d+)/(\d+) tokens\), "
                  r"Mean acceptance length: ([\d.]+)", drafted.err)
    assert m, drafted.err[-2000:]
    rate, accepted, tokens = float(m[1]), int(m[2]), int(m[3])
    assert 0 < accepted <= tokens and rate == pytest.approx(100 * accepted / tokens, abs=0.05)
    assert 1 < float(m[4]) <= 4
    assert "Speculative decoding, prompt" not in drafted.err

    # With --per-request-spec-decode-metrics, each prompt's figures too: here one prompt, so the run's.
    assert main([*argv, "--speculative-config", spec, "--per-request-spec-decode-metrics", "summary"]) == 0
    per_request = capsys.readouterr()
    assert per_request.out == plain.out
    line = re.search(r"Speculative decoding, prompt 0: (.*)", per_request.err)
    figures = json.loads(line[1])
    assert (figures["num_accepted_draft_tokens"], figures["num_draft_tokens"]) == (accepted, tokens)


def test_serve_models_from_the_command_line_and_a_file(tmp_path):
    from kvserve.entrypoints.cli import models_config

    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    assert models_config(parse()) is None and models_config(parse("smollm2-135m")) is None   # the one-model server
    assert engine_config(parse("smollm2-135m")).model == "smollm2-135m"
    two = models_config(parse("smollm2-135m", "gemma3-270m", "--max-waiting", "7"))
    assert [m.name for m in two.models] == ["smollm2-135m", "gemma3-270m"] and two.admission.max_waiting == 7
    dp = models_config(parse("--data-parallel-size", "2", "--routing-policy", "round_robin",
                             "--served-model-name", "smol"))
    assert dp.models[0].name == "smol" and dp.models[0].data_parallel_size == 2
    assert dp.models[0].model == "smollm2-135m" and dp.routing.policy == "round_robin"
    # Replicas of the default model answer to the name one engine of it answers to.
    from kvserve.entrypoints.openai.api_server import ServerArgs
    assert models_config(parse("--data-parallel-size", "2")).model_names() == ServerArgs().model_names()
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: a, model: smollm2-135m, data_parallel_size: 3}\nrouting: {policy: least_loaded}\n")
    cfg = models_config(parse("--models-config", str(path)))
    assert cfg.models[0].data_parallel_size == 3 and cfg.routing.policy == "least_loaded"
    assert cfg.admission.max_waiting == 256
    for bad in (("smollm2-135m", "--models-config", str(path)), ("a", "b", "--served-model-name", "x")):
        with pytest.raises(ValueError):
            models_config(parse(*bad))
    # Errors reach the user as one line naming the field, not a traceback.
    path.write_text("models:\n  - {name: a, model: x, data_parallel_size: 0}\n")
    assert main(["serve", "--models-config", str(path)]) == 2


@pytest.mark.parametrize("argv", [
    ["generate", "--num-kv-blocks", "-1"], ["generate", "--num-kv-blocks", "0"], ["generate", "--max-model-len", "0"],
    ["generate", "--num-threads", "-1"], ["generate", "--device", "tpu"], ["generate", "--device", ""],
    ["serve", "--port", "73597"], ["serve", "--port", "-1"], ["serve", "--device", "mps"],
    ["generate", "--num-threads", str(10**30)], ["serve", "--data-parallel-size", str(10**30)],
    ["serve", "--data-parallel-size", "0"], ["serve", "--max-waiting", "-1"],
    ["serve", "--max-request-body-bytes", "-1"], ["serve", "--shutdown-grace", "-1"],
    ["serve", "--shutdown-grace", "nan"], ["serve", "--log-stats-interval", "0"], ["serve", "--api-key", ""],
    ["serve", "--api-key", "good", " "]])
def test_bad_flag_values_are_refused_by_the_parser_naming_the_flag(argv, capsys):
    # Each was taken before: a traceback from torch or uvicorn, silently ignored (0), misreported under another
    # flag, or (port 73597) wrapped around to another port while the log said the first; 10**30 threads gave
    # "Overflow when unpacking long long" and 10**30 replicas grew a list until memory ran out.
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {argv[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["generate", "a-model", "--model", "another"], "the model is given twice"),
    (["serve", "a-model", "b-model", "--model", "a-model"], "the model is given twice"),
    (["generate", ""], "model is empty"), (["generate", "--model", ""], "model is empty"),
    (["serve", "--tokenizer", ""], "tokenizer is empty")])
def test_a_model_given_twice_or_empty_is_refused(argv, said, capsys):
    # One of two models was dropped silently; '' read as the current directory (--model '' as the default model).
    assert main(argv + ["--prompt", "hi"] * (argv[0] == "generate")) == 2
    assert said in capsys.readouterr().err


def test_the_same_model_given_twice_is_taken(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    args = build_parser().parse_args(["generate", str(path), "--model", str(path)])
    assert engine_config(args).model == str(path)


@pytest.mark.timeout(300)
def test_generate_reads_windows_lines_numbers_samples_and_refuses_chat_without_a_template(tiny_model_dirs, tmp_path,
                                                                                          capsys, monkeypatch):
    import io
    path, _ = tiny_model_dirs["llama"]
    flags = ["--max-tokens", "3", "--dtype", "float32", "--max-model-len", "64"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\r\nthere\r\n"))  # the "\r" was kept in the prompt
    assert main(["generate", str(path), *flags, "--n", "2", "--temperature", "1.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("---")] == [
        "--- prompt 0, sample 0: 'hi'", "--- prompt 0, sample 1: 'hi'",
        "--- prompt 1, sample 0: 'there'", "--- prompt 1, sample 1: 'there'"]
    assert not any("\r" in line for line in lines)
    # The HTTP wording ("use completions, not chat") told a shell user nothing. A copy of the model without the
    # chat template in its tokenizer_config.json: a base model.
    import shutil
    base = tmp_path / "base"
    shutil.copytree(path, base)
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert main(["generate", str(base), *flags, "--chat", "--prompt", "hi"]) == 2
    assert "the model has no chat template (a base model takes plain text): leave out --chat" in capsys.readouterr().err


def test_generate_checks_sampling_flags_before_loading_the_model(capsys):
    # A bad --max-tokens was reported after the model's load (seconds); here the model does not even exist.
    assert main(["generate", "/nonexistent/model", "--prompt", "hi", "--max-tokens", "-1"]) == 2
    assert "max_tokens must be an integer >= 1, got -1" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_any_integer_is_an_engine_seed(tiny_model_dirs, capsys):
    # torch.manual_seed overflowed past 64 bits ("Overflow when unpacking long long", naming no flag).
    path, _ = tiny_model_dirs["llama"]
    for seed in (str(10**30), str(-10**30)):
        assert main(["generate", str(path), "--seed", seed, "--prompt", "hi", "--max-tokens", "3",
                     "--temperature", "1.0", "--dtype", "float32", "--max-model-len", "64"]) == 0
        assert capsys.readouterr().out.startswith("hi")


def test_a_kv_cache_larger_than_memory_is_refused_before_it_is_allocated(capsys):
    # It grew until the kernel killed the process (no message), or at 10**30 blocks hung building its list.
    for flags in (["--num-kv-blocks", str(10**12)], ["--kv-cache-memory", "100TiB"]):
        assert main(["generate", "--prompt", "hi", "--max-tokens", "2", *flags]) == 2
        assert "is available: lower num_kv_blocks or kv_cache_memory" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_serve_that_cannot_start_its_engine_says_why_in_one_line(tmp_path):
    # The engine process refuses the configuration (no such draft model) after the server has started:
    # the user gets that reason and a failing exit status, not the engine's and uvicorn's tracebacks.
    missing = tmp_path / "no-such-draft"
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "0",
                          "--max-model-len", "256", "--speculative-config",
                          f'{{"method": "draft", "num_speculative_tokens": 3, "model": "{missing}"}}'],
                         capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    reason = [line for line in out.stderr.splitlines() if "engine failed to start" in line]
    assert len(reason) == 1 and f"model '{missing}' does not exist" in reason[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(300)
def test_a_models_config_entry_that_cannot_start_is_named(tiny_model_dirs, tmp_path):
    # Two entries of one model, the second with a draft that does not exist: the one line names the entry too.
    path, _ = tiny_model_dirs["llama"]
    missing = tmp_path / "no-such-draft"
    spec = {"method": "draft", "num_speculative_tokens": 2, "model": str(missing)}
    config = tmp_path / "models.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": "plain", "model": str(path)},
                                                 {"name": "drafted", "model": str(path),
                                                  "engine": {"speculative_config": spec}}]}))
    out = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--port", "0", "--models-config",
                          str(config), "--max-model-len", "256", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=280, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    reason = [line for line in out.stderr.splitlines() if "engine failed to start" in line]
    assert len(reason) == 1 and "model 'drafted': engine failed to start" in reason[0], out.stderr[-3000:]
    assert f"model '{missing}' does not exist" in reason[0] and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_every_served_model_name_is_kept_with_replicas():
    """--served-model-name a b with --data-parallel-size answered only to a (b had been a 404, and unlisted)."""
    from fastapi.testclient import TestClient

    from kvserve.entrypoints.cli import _server_args, models_config
    from kvserve.entrypoints.openai.api_server import build_app

    args = build_parser().parse_args(["serve", "smollm2-135m", "--data-parallel-size", "2",
                                      "--served-model-name", "a", "b"])
    server_args = _server_args(args, engine_config(args), models_config(args))
    client = TestClient(build_app(server_args))  # no engine started: /v1/models reads the registry
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["a", "b"]
    assert client.get("/v1/models/b").status_code == 200


@pytest.mark.parametrize("flag, origin, allowed", [
    ([], "http://any.example", "*"),                                                # vLLM's default: any
    (["--allowed-origins", "http://a.example"], "http://a.example", "http://a.example"),
    (["--allowed-origins", "http://a.example"], "http://b.example", None),
    (["--allowed-origins"], "http://a.example", None),                              # the flag alone: no CORS
])
def test_allowed_origins(flag, origin, allowed):
    from fastapi.testclient import TestClient

    from kvserve.entrypoints.cli import _server_args, models_config
    from kvserve.entrypoints.openai.api_server import build_app

    args = build_parser().parse_args(["serve", *flag])
    client = TestClient(build_app(_server_args(args, engine_config(args), models_config(args))))
    r = client.get("/v1/models", headers={"Origin": origin})
    assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == allowed
