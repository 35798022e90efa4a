"""Engine configuration: one dataclass a user fills in, passed down to every layer that needs it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.utils.value_checks import is_int

BatchingPolicy = Literal["continuous", "static", "dynamic"]
SchedulingPolicy = Literal["fcfs", "priority"]
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight formats: see kvserve/layers/quantization
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")  # auto: the compute dtype
# vLLM's "fp8" is its fp8_e4m3 (outside ROCm), so a command line written for vLLM runs unchanged.
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # see kvserve/attention/selector.py
PER_REQUEST_SPEC_DECODE_METRICS = ("none", "summary", "detailed")


# torch takes a 32-bit thread count and would try to start as many as it is given: a bound against typos.
MAX_NUM_THREADS = 1024


@dataclass
class EngineConfig:
    # What to load. None means the embedded default (SmolLM2-135M-Instruct, see kvserve/models/default.py).
    model: str | None = None
    tokenizer: str | None = None          # an HF directory or .gguf whose tokenizer replaces the model's own
    dtype: str = "auto"                   # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"                  # "auto" picks CUDA when present, else CPU
    # Weight format: "auto" keeps a GGUF file's quantized blocks (and float weights as floats); "none"
    # dequantizes to dtype; "int8" / "int4" quantize every linear layer at load (kvserve/layers/quantization).
    quantization: str = "auto"
    quant_group_size: int = 32            # int4's group: 32 or 128
    seed: int = 0

    # KV cache. kv_cache_memory: bytes (int >= 1) or a fraction of free memory (0 < float <= 1).
    # Without it, on CUDA: gpu_memory_utilization of the GPU's total memory is the engine's, and the KV pool
    # gets what the weights and a profiled worst-case step leave (kvserve/worker/memory_profile.py).
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    # "fp8_e4m3" stores K and V in 8 bits (half of bf16's bytes, so twice the tokens fit); attention still
    # computes in float32.
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | float | None = None
    num_kv_blocks: int | None = None      # overrides kv_cache_memory; tests use it to force pressure
    enable_prefix_caching: bool = True
    max_model_len: int | None = None      # defaults to the model's context length

    # Scheduler.
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    scheduling_policy: SchedulingPolicy = "fcfs"
    batching: BatchingPolicy = "continuous"
    dynamic_batch_window_s: float = 0.05  # "dynamic": wait this long for a batch to fill
    max_waiting: int | None = None        # admission control in the server (None: unbounded)

    # "auto": Triton on CUDA when triton is installed, else torch (native CPU kernels where they apply);
    # "torch" | "triton" force one (kvserve/attention/selector.py).
    attention_backend: str = "auto"
    # CPU: every row's attention on the native kernel at any context, so that what a request's steps also carry
    # (other requests, drafts, a prefix-cache hit: where a long prompt is cut into chunks) cannot change its
    # output. Off, prompt chunks of more than 16 tokens past 4096 tokens of context (1024 with AVX2) go to
    # torch's SDPA, which is faster there (kvserve/attention/torch_plan.py).
    batch_invariant: bool = False
    # CUDA with the Triton backend: pure-decode steps replay CUDA graphs captured at startup
    # (kvserve/worker/cuda_graphs.py); True runs every step eagerly.
    enforce_eager: bool = False

    num_threads: int | None = None        # torch intra-op threads on CPU; None leaves torch's choice

    # Speculative decoding: a SpeculativeConfig or its dict / JSON text, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Per-request acceptance figures (vLLM's --per-request-spec-decode-metrics): "none" collects nothing;
    # "summary" counts each request's drafts and accepted tokens; "detailed" also keeps them step by step.
    # Requests of one sequence only (outputs.SpecDecodeMetrics); an engine without speculative decoding ignores it
    # (with a warning), so that it can be every model's default in a server of several.
    per_request_spec_decode_metrics: str = "none"

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):  # '' read as the current directory, or (--model '') as the default
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty: give a preset name, a Hugging Face directory or a .gguf file "
                                 f"(or leave it out)")
        # A YAML models config hands these over as written: `num_threads: true` or `max_num_seqs: 2.5` must fail
        # here, not as a float deep in the scheduler or Ray's placement.
        if self.num_threads is not None and (not is_int(self.num_threads)
                                             or not 1 <= self.num_threads <= MAX_NUM_THREADS):
            raise ValueError(f"num_threads must be an integer in [1, {MAX_NUM_THREADS}], got {self.num_threads!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks", "max_waiting"):  # LLM(max_model_len=0) meant the default
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None), got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.batching not in ("continuous", "static", "dynamic"):
            raise ValueError(f"batching must be continuous|static|dynamic, got {self.batching!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs|priority, got {self.scheduling_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be {'|'.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quant_group_size not in (32, 128):
            raise ValueError(f"quant_group_size must be 32 or 128, got {self.quant_group_size}")
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be {'|'.join(KV_CACHE_DTYPES)} ('fp8' is taken for 'fp8_e4m3'), "
                             f"got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be {'|'.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            k = self.speculative_config.num_speculative_tokens
            if k >= self.max_num_batched_tokens:  # a verification row of 1 + k tokens could never be scheduled
                name = (f"suffix_decoding_max_tree_depth ({k}, num_speculative_tokens' default)"
                        if self.speculative_config.k_from_depth else f"num_speculative_tokens ({k})")
                raise ValueError(f"speculative_config: {name} must be below "
                                 f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.per_request_spec_decode_metrics not in PER_REQUEST_SPEC_DECODE_METRICS:
            raise ValueError(f"per_request_spec_decode_metrics must be {'|'.join(PER_REQUEST_SPEC_DECODE_METRICS)}, "
                             f"got {self.per_request_spec_decode_metrics!r}")


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, as read from config.json or GGUF metadata."""
    architecture: str                     # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # HF form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # Qwen2: bias on q/k/v projections
    qk_norm: bool = False                 # Qwen3: RMSNorm on each head of q and k
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3. None everywhere else: every layer alike, one RoPE base, scores scaled by head_dim ** -0.5.
    layer_types: list[str] | None = None  # per layer: "sliding_attention" (sliding_window) | "full_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (rope_scaling: global only)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its ** -0.5
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
