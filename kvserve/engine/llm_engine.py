"""The engine: requests in, one scheduling step at a time, outputs out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Request.append_token (stops, text) -> RequestDelta

step_deltas() hands back, per touched request, only what the step added (what the engine process sends);
step() folds those into vLLM's cumulative RequestOutput for in-process callers (the offline LLM).

With speculative decoding, a Speculator drafts tokens for the decoding sequences before each schedule; a
step may then append several tokens to a sequence (the accepted drafts and one more), and its
num_computed_tokens counts only the verified positions it kept.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import numbers
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from kvserve.attention.backend import FP8
from kvserve.attention.kv_scales import CALIBRATION_TEXT, calibrate_kv_scales
from kvserve.config import EngineConfig
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.engine.stats import EngineStats
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import weight_formats
from kvserve.models.kv_cache import kv_cache_spec
from kvserve.models.loader import load_model
from kvserve.models.presets import resolve_model
from kvserve.outputs import (PositionLogprobs, RequestDelta, RequestMetrics, RequestOutput, RequestOutputAccumulator,
                             SpecDecodeMetrics)
from kvserve.sampling.sampler import cpu_seed, make_generator
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.draft_model import load_draft
from kvserve.spec_decode.draft_proposer import DraftProposer
from kvserve.spec_decode.eagle_head import head_quantization, load_eagle_head
from kvserve.spec_decode.eagle_proposer import EagleProposer
from kvserve.spec_decode.ngram import Indents, token_texts, whitespace_classes
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.verify import kept_alternative
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.utils.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from kvserve.worker.memory_profile import profile_kv_budget, worst_case_batch
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30        # a fixed KV space, as vLLM sizes it on CPU; ~46k tokens of the default model


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(cpu_seed(config.seed))  # any int, as a request's seed (torch's own overflowed past 64 bits)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, self.dtype, self.device, config.tokenizer, config.quantization,
                            config.quant_group_size)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = list(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)

        mc = self.model_config
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype,
            cpu_auto=self.device.type == "cpu" and config.dtype == "auto" and cpu_kernels.available())
        kv_spec = kv_cache_spec(mc, config.block_size, self.kv_cache_dtype)
        block_bytes = kv_spec.bytes_per_block
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length "
                             f"({mc.max_position_embeddings})")
        max_model_len = config.max_model_len or mc.max_position_embeddings
        spec = config.speculative_config
        if spec is not None:
            self._check_draft_fields(spec, max_model_len)
        draft_model = draft_kv_spec = None
        if spec is not None and spec.method == "draft":
            # The draft's KV pool is addressed by the same block ids: each block costs both pools' bytes.
            draft_model = load_draft(spec.model, loaded, self.dtype, self.device, config.quantization,
                                     spec.quantization)
            draft_kv_spec = kv_cache_spec(draft_model.config, config.block_size, self.kv_cache_dtype)
            block_bytes += draft_kv_spec.bytes_per_block
        eagle_head = None
        if spec is not None and spec.method == "eagle":  # before the KV sizing, which counts what is loaded
            eagle_head = load_eagle_head(spec.model, loaded, self.dtype, self.device,
                                         head_quantization(config.quantization, self.device, spec.quantization))
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory is None and self.device.type == "cuda":
            # Profiling sizes the target's pool; the draft's share comes out of the same bytes.
            num_blocks = self._num_blocks_by_profiling(loaded.model, kv_spec) * kv_spec.bytes_per_block // block_bytes
        else:
            num_blocks = self._num_blocks_for_budget(block_bytes)
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is too small to hold a single KV block")
        # A pool past the memory there is would grow until the kernel kills the process (no message), or, at
        # 10**30 blocks, hang building its block list.
        free = self._free_memory()
        if num_blocks * block_bytes > free:
            gib = 1 << 30
            raise ValueError(f"a KV cache of {num_blocks} blocks needs {num_blocks * block_bytes / gib:.1f} GiB, and "
                             f"{free / gib:.1f} GiB is available: lower num_kv_blocks or kv_cache_memory")
        # A sequence must fit in the pool on its own, or preemption could not always make room for it. The
        # model's own length is cut to the pool; one asked for is refused rather than cut, as vLLM refuses it
        # (cut quietly, it surfaced later as prompts refused below the length given).
        pool_tokens = num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > pool_tokens:
            raise ValueError(f"max_model_len={config.max_model_len} is more than the KV cache holds ({num_blocks} "
                             f"blocks of {config.block_size} = {pool_tokens} tokens): lower max_model_len or give "
                             f"the cache more (kv_cache_memory, num_kv_blocks; on CUDA gpu_memory_utilization)")
        self.max_model_len = min(max_model_len, pool_tokens)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        if config.batch_invariant and self.device.type != "cpu":
            raise ValueError("batch_invariant applies to the CPU's attention kernels; on CUDA it is not available")
        # Unseeded sampling draws from the engine's own generator: torch's default one is the process's, which
        # another engine (or the caller) may seed again mid-run.
        self.rng = make_generator(config.seed, self.device)
        self.runner = ModelRunner(loaded.model, kv_spec, num_blocks, self.device, self.eos_token_ids, self.dtype,
                                  config.attention_backend, config.batch_invariant, generator=self.rng)
        if spec is not None and spec.num_alternatives and not self.runner.attn_backend.supports_tree_drafts:
            raise ValueError(f"speculative_config: speculative_token_tree with alternatives needs an attention "
                             f"backend that takes tree rows ('torch' or 'triton'); this engine runs "
                             f"{self.runner.attn_backend.name!r}. Use a chain (no speculative_token_tree)")
        draft = (DraftProposer(draft_model, draft_kv_spec, num_blocks, self.device, self.eos_token_ids, self.dtype,
                               config.attention_backend, generator=self.rng) if draft_model is not None else None)
        if eagle_head is not None:
            draft = EagleProposer(eagle_head, self.device, self.eos_token_ids, generator=self.rng)
        if self.kv_cache_dtype == FP8:  # before graph capture: the graphs take the scales as constants
            # An eagle head keeps no K/V (its state is one vector per sequence): a draft model's pool only.
            self._calibrate_kv_scales(self.runner, draft if isinstance(draft, DraftProposer) else None)
        if self.device.type == "cuda" and not config.enforce_eager and self.runner.attn_backend.name == "triton":
            verify_seqs = 0 if spec is None else spec.drafting_seqs(config.max_num_seqs)
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len,
                                       1 + spec.num_speculative_tokens if spec is not None else None, verify_seqs)
            if isinstance(draft, EagleProposer) and verify_seqs and not spec.enforce_eager:
                draft.model.capture_graphs(verify_seqs)
        self.speculator = None
        if spec is not None:
            if not self.runner.rows_alike():
                # Measured with --quantization none in bfloat16 on AVX-512 before float weights had a CPU kernel:
                # 52 of 156 requests' logprobs moved, by up to 0.24 nats, and some greedy and seeded outputs
                # changed; in float32 by up to 5e-5 (3.6e-5 in session 73's check, 7.6e-6 in session 76's,
                # tokens unchanged), which is still not the bit-for-bit identity promised elsewhere.
                how = ("logprobs move in the last digits (up to 5e-5 measured) and a near-tie can flip a token"
                       if self.dtype == torch.float32 else "outputs can differ from decoding without speculation "
                       "(as a different batch can)")
                logger.warning("speculative decoding: the model's linear layers or attention run torch's %s "
                               "matmuls, which round a verification step's rows differently from a decode step's, "
                               "so %s. kvserve's CPU kernels (x86 with AVX2 or AVX-512; attention heads of 16, 32, "
                               "64, 128 or 256) give the same bits", str(self.dtype).removeprefix("torch."), how)
            classes = indents = None
            if spec.matches_text:  # ngram, suffix, or prompt lookup in front of a draft model or eagle head
                texts = token_texts(self.tokenizer)
                classes = whitespace_classes(self.tokenizer, mc.vocab_size, texts)
                indents = Indents(texts[:mc.vocab_size])  # it drafts ids of its own: only ones the model has
            self.speculator = Speculator(spec, self.max_model_len, config.max_num_batched_tokens, draft, classes,
                                         step_tokens=self.runner.step_tokens, indents=indents)
        elif config.per_request_spec_decode_metrics != "none":
            logger.warning("per_request_spec_decode_metrics=%s has no effect without speculative decoding "
                           "(speculative_config)", config.per_request_spec_decode_metrics)
        self.requests: dict[str, Request] = {}
        self._accumulators: dict[str, RequestOutputAccumulator] = {}   # only for callers of step()
        self._seq_ids = itertools.count()
        self._token_text: dict[int, str] = {}
        self._num_steps = 0
        self._num_generation_tokens = 0
        self._num_prompt_tokens = 0
        self._last_step_tokens = 0
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s), max_model_len %d, dtype %s, device %s",
                    num_blocks, config.block_size, num_blocks * block_bytes / 2**20, self.kv_cache_dtype,
                    self.max_model_len, self.dtype, self.device)

    def _calibrate_kv_scales(self, *runners: ModelRunner | DraftProposer | None) -> None:
        """Per-layer float8 K/V scales from a fixed text (kvserve/attention/kv_scales.py), for the target
        and the draft model alike; the text is cut to what the pool and the context hold."""
        ids = self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
        ids = ids[:min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)]
        for r in runners:
            if r is not None:
                calibrate_kv_scales(r.model, r.attn_backend, r.kv_caches, r.block_size, ids, self.device)

    def _check_draft_fields(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        """speculative_config's fields that only the engine can check: against the target's context length (as
        vLLM checks them) and the device."""
        if spec.max_model_len is not None and spec.max_model_len > max_model_len:
            raise ValueError(f"speculative_config: max_model_len ({spec.max_model_len}) cannot be larger than the "
                             f"target's ({max_model_len})")
        if spec.quantization in ("int8", "int4") and self.device.type != "cpu":
            raise ValueError(f"speculative_config: quantization {spec.quantization!r} (the draft's weights) runs on "
                             f"the CPU only for now; on {self.device.type} give 'auto' or 'none'")

    def _num_blocks_by_profiling(self, model: torch.nn.Module, kv_spec) -> int:
        """CUDA: the blocks that fit in gpu_memory_utilization of the GPU once a worst-case step has run
        (kvserve/worker/memory_profile.py), on a throwaway runner with just the blocks that step needs."""
        cfg = self.config
        probe_blocks = worst_case_batch(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size).num_blocks
        spec = cfg.speculative_config
        draft_rows = 0 if spec is None else spec.drafting_seqs(cfg.max_num_seqs) * spec.num_speculative_tokens

        def worst_case_step() -> None:
            probe = ModelRunner(model, kv_spec, probe_blocks, self.device, self.eos_token_ids, self.dtype,
                                cfg.attention_backend)
            probe.profile_run(cfg.max_num_batched_tokens, cfg.max_num_seqs, draft_rows)

        kv_bytes, p = profile_kv_budget(worst_case_step, self.device, cfg.gpu_memory_utilization,
                                        probe_blocks * kv_spec.bytes_per_block)
        gib = 2 ** 30
        logger.info("GPU memory: %.2f GiB total x %.2f utilization; weights %.2f GiB, activation peak %.2f GiB, "
                    "outside torch %.2f GiB -> KV cache %.2f GiB", p.total_bytes / gib, cfg.gpu_memory_utilization,
                    p.weights_bytes / gib, p.activation_peak_bytes / gib, p.non_torch_bytes / gib, kv_bytes / gib)
        return kv_bytes // kv_spec.bytes_per_block

    def _free_memory(self) -> int:
        """Bytes free on the engine's device: the GPU's, else the host's available memory."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else _available_host_memory()

    def _num_blocks_for_budget(self, block_bytes: int) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:  # a CPU (CUDA without kv_cache_memory is sized by profiling)
            budget = min(DEFAULT_CPU_KV_BYTES, int(0.5 * _available_host_memory()))
        if isinstance(budget, float) and budget <= 1.0:
            if not 0 < budget:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {budget}")
            budget = int(budget * self._free_memory())
        return int(budget) // block_bytes

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request. cache_salt: only requests with the same salt share prefix-cache blocks
        (e.g. one salt per tenant, so one cannot probe another's prompts by timing)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        # The request's own copy, made through the constructor: fields set after construction (sp.stop = "x",
        # sp.temperature = 1e-9, sp.top_k = -1) get the same conversions and checks as constructor arguments
        # (they skipped them); deep, so that later changes to the caller's logit_bias reach no running request.
        params = copy.deepcopy(dataclasses.replace(params))
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_text = None
            token_ids = list(prompt)
            kind = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
            if kind is not None:  # 1.0 was said to be "outside the vocabulary"
                raise ValueError(f"prompt token ids must be integers, got {kind!r} ({type(kind).__name__})")
            token_ids = [int(t) for t in token_ids]  # numpy ids as Python ints
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt contains token id {bad!r}, outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(f"prompt is {n_prompt} tokens, but max_model_len is {self.max_model_len}: "
                             "the prompt must leave room for at least one output token")
        # No max_tokens, or more than the context has room for: the request ends at max_model_len, finish_reason
        # "length", as vLLM's engine ends it (the server refuses the latter with a 400 first, as vLLM's does).
        if params.max_tokens is None or n_prompt + params.max_tokens > self.max_model_len:
            params.max_tokens = self.max_model_len - n_prompt
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} has token id {bad}, outside the vocabulary [0, {vocab})")
        if params.top_k >= vocab:  # keeping every token is no top-k (a top_k past int64 had failed the whole step)
            params.top_k = 0
        # Checked here, not in the step that hashes the prompt's blocks: a bad salt failed every request in it.
        if cache_salt is not None and not _valid_text(cache_salt):
            raise ValueError(f"cache_salt must be a string of valid Unicode, got {cache_salt!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")

        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        if self.config.enable_prefix_caching:
            salt = cache_salt
        else:
            # Siblings of an n > 1 request still share the prompt, through a cache only they can see.
            salt = f"req:{request_id}" if params.n > 1 else None
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=list(token_ids),
                num_prompt_tokens=n_prompt, params=params, priority=priority, arrival_time=arrival,
                parent=seqs[0] if seqs else None, cache_salt=salt, tenant_salt=cache_salt,
                # One sequence computes the prompt's logprobs for the whole request.
                needs_prompt_logprobs=params.prompt_logprobs is not None and i == 0,
            )
            if params.seed is not None:
                seq.generator = make_generator(params.seed + i, self.device)
            elif self.speculator is not None and self.speculator.couples_noise and not params.greedy:
                # The draft samples with the noise the target will use (spec_decode/draft_proposer.py).
                seq.generator = make_generator(int(torch.randint(2**62, (), generator=self.rng, device=self.device)),
                                               self.device)
            seqs.append(seq)
        backend = self.tokenizer.backend
        detoks = [IncrementalDetokenizer(backend, token_ids, params) for _ in seqs]
        self.requests[request_id] = Request(
            request_id=request_id, prompt=prompt_text, prompt_token_ids=list(token_ids), params=params,
            seqs=seqs, detokenizers=detoks, metrics=RequestMetrics(arrival_time=arrival),
            eos_token_ids=frozenset(self.eos_token_ids), max_model_len=self.max_model_len,
            spec_decode=self._spec_decode_metrics(params.n),
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def _spec_decode_metrics(self, n: int) -> SpecDecodeMetrics | None:
        """A request's per-request acceptance figures, where asked for: with one sequence (n > 1 would mix its
        sequences' steps), as vLLM reports them."""
        level = self.config.per_request_spec_decode_metrics
        if level == "none" or self.speculator is None or n != 1:
            return None
        detailed = level == "detailed"
        return SpecDecodeMetrics(self.speculator.config.num_speculative_tokens,
                                 per_step_drafted=[] if detailed else None, per_step_accepted=[] if detailed else None)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            self._accumulators.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; for each request it touched, everything generated so far (vLLM's RequestOutput)."""
        outputs = []
        for req, delta in self._step():
            acc = self._accumulators.get(req.request_id)
            if acc is None:
                acc = self._accumulators[req.request_id] = RequestOutputAccumulator(
                    req.request_id, req.prompt, req.prompt_token_ids, len(req.seqs), req.params.logprobs is not None)
            outputs.append(acc.add(delta))
            if delta.finished:
                del self._accumulators[req.request_id]
        return outputs

    def step_deltas(self) -> list[RequestDelta]:
        """One step; for each request it touched, only what this step added."""
        return [delta for _, delta in self._step()]

    def _step(self) -> list[tuple[Request, RequestDelta]]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.fill_drafts(sched)
        self._num_steps += 1
        self._last_step_tokens = sched.num_batched_tokens
        if sched.is_empty:
            return []
        if self.speculator is not None:
            self.runner.keep_hidden = self.speculator.wants_hidden(len(self.scheduler.running))
        now = started = time.monotonic()
        for seq, _ in sched.scheduled:
            m = self.requests[seq.request_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.runner.execute(sched)
        now = time.monotonic()

        touched: dict[str, Request] = {}
        for seq, n in sched.scheduled:
            req = self.requests[seq.request_id]
            start = seq.num_computed_tokens
            chunk = result.prompt_logprobs.get(seq.seq_id)
            if chunk is not None and seq.index == 0:
                # chunk[j] is for prompt token start + 1 + j; a resumed (preempted) sequence recomputes
                # positions we already have, so keep only the new ones.
                have = len(req.prompt_logprobs)
                req.prompt_logprobs.extend(self._with_text(lp) for lp in chunk[have - start - 1:])
                if len(req.prompt_logprobs) == seq.num_prompt_tokens:
                    seq.needs_prompt_logprobs = False  # a later resume (after preemption) may use the cache
            sampled = result.sampled.get(seq.seq_id)
            if sampled is None:
                seq.num_computed_tokens = start + n
                self.block_manager.commit_full_blocks(seq)
                continue
            tokens, logprobs = sampled
            drafts = sched.spec_token_ids.get(seq.seq_id, ())
            if drafts:
                alternatives = sched.spec_alternatives.get(seq.seq_id, 0)
                self.speculator.record(seq, len(drafts) - alternatives, len(tokens) - 1, alternatives,
                                       kept_alternative(tokens, drafts, alternatives))
                if req.spec_decode is not None:
                    req.spec_decode.add(len(drafts), len(tokens) - 1)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                self._num_prompt_tokens += len(req.prompt_token_ids)
            req.metrics.last_token_time = now
            finished = False
            appended = 0
            for token, lp in zip(tokens, logprobs):  # stops inside an accepted run end it there
                appended += 1
                finished = req.append_token(seq, token, self._with_text(lp) if lp else lp)
                if finished:
                    break
            self._num_generation_tokens += appended
            hidden = result.hidden.get(seq.seq_id)
            if hidden is not None and not finished:
                self.speculator.observe(seq, hidden)
            # The K/V written for rejected drafts (and for drafts after a stop) stay in the blocks as
            # garbage that the tokens computed there later overwrite; only the kept positions count, and
            # blocks that held nothing else go back to the pool.
            seq.num_computed_tokens = start + n - len(drafts) + appended - 1
            self.block_manager.commit_full_blocks(seq)
            if drafts and not finished:
                self.block_manager.trim(seq)
            if finished:
                self.scheduler.finish(seq)
                if self.speculator is not None:
                    self.speculator.finished(seq)
            touched[req.request_id] = req
        if self.speculator is not None:
            self.speculator.observe_step(self.runner.last_step_tokens, time.monotonic() - started)

        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            outputs.append((req, req.take_delta()))
        return outputs

    def _with_text(self, lp: PositionLogprobs) -> PositionLogprobs:
        for tok, entry in lp.items():
            if entry.decoded_token is None:
                text = self._token_text.get(tok)
                if text is None:
                    text = self._token_text[tok] = self.tokenizer.decode([tok], skip_special_tokens=False)
                entry.decoded_token = text
        return lp

    # ---- introspection -------------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        """What a figure measured on this engine depends on, as text (the server's kvserve:engine_info labels,
        which `kvserve bench` records): where it runs and in what formats."""
        c = self.config
        # The model file's name only: /metrics is open without a key, and a path says more than it should.
        kernels = cpu_kernels.applies(torch.empty(0, dtype=self.dtype, device=self.device))
        return {"model": Path(resolve_model(c.model)).name,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "cpu_kernels": cpu_kernels.describe() if kernels else "none",
                "attention_backend": self.runner.attn_backend.name,
                "num_threads": str(torch.get_num_threads()), "torch": str(torch.__version__),
                "dtype": str(self.dtype).removeprefix("torch."), "quantization": c.quantization,
                "weights": weight_formats(self.runner.model),
                "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                "block_size": str(c.block_size), "num_kv_blocks": str(self.block_manager.num_blocks),
                "max_model_len": str(self.max_model_len), "prefix_caching": str(c.enable_prefix_caching).lower(),
                "speculative": "none" if c.speculative_config is None else c.speculative_config.method}

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_steps=self._num_steps,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            last_step_num_tokens=self._last_step_tokens,
            **(self._spec_stats() if self.speculator is not None else {}),
        )

    def _spec_stats(self) -> dict:
        s = self.speculator.stats
        return dict(spec_decode_enabled=True, spec_num_drafts=s.num_drafts, spec_num_draft_tokens=s.num_draft_tokens,
                    spec_num_accepted_tokens=s.num_accepted_tokens, spec_accepted_per_pos=list(s.accepted_per_pos))

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _valid_text(value: object) -> bool:
    """A str that UTF-8 can encode (a lone surrogate, "\\ud800", cannot)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
